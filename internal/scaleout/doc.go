// Package scaleout holds keel's tests against Redis Cluster and Redis
// Sentinel, and with Postgres restarted: workers, relays and schedulers
// must keep the ledger's invariants when Redis is not a single server, when
// its master dies, and when the ledger goes away for a while.
//
// Steady state (scaleout_test.go): two workers on a 3-master cluster and
// behind one sentinel. Failover (sentinel_failover_test.go,
// cluster_failover_test.go): a master, two replicas and three sentinels, or
// three masters with a replica each; two workers, a flow limit, a scheduler
// and the dashboard run on the group while jobs are enqueued, and the master
// is SIGKILLed after it took writes no replica received. Every job must run
// once and succeed, the dropped writes come back from the ledger, and the
// scheduler, the flow limit and the dashboard must work on the new master.
//
// Postgres restart (postgres_test.go): a private Postgres has every keel
// connection cut and is stopped mid-run, briefly and for longer than a
// lease. No job may be lost, repeated, charged an attempt or retired, and
// everything must work again without a restart.
//
// # The Redis commands keel runs itself
//
// Beside asynq's own (its client, server, inspector and asynqmon, whose keys
// all carry the queue's hash tag, asynq:{<queue>}:…), keel runs these. Every
// script's keys share one slot; pipelines may span slots, as go-redis
// splits them per node. crossslot_test.go runs each on a cluster and checks
// that no node counted a CROSSSLOT refusal.
//
//	flow (package flow), keys keel:flow:{<rule>}:slots and :rate, one per call
//	  acquire script  ZREMRANGEBYSCORE ZSCORE ZCARD ZADD PTTL PEXPIRE TIME  {<rule>}:slots
//	  renew script    ZSCORE ZADD PTTL PEXPIRE TIME                         {<rule>}:slots
//	  release         ZREM                                                  {<rule>}:slots
//	  reserve script  TIME GET SET PX                                       {<rule>}:rate
//	publisher (package idempotency: Enqueue, EnqueueTx's relay, republishing)
//	  publish script  EXISTS LPUSH ZADD HSET  asynq:{q}:pending :scheduled,
//	                  asynq:{q}:t:<id>…  (the jobs of one queue per call)
//	  queue registry  SADD asynq:queues <queue>  (one key)
//	rescuer and reconciler (package outbox), asynq's layout
//	  requeue-active script  HGET ZSCORE LREM ZREM RPUSH HSET
//	                         asynq:{q}:t:<id> :active :lease :pending
//	  forward-now script     HGET ZREM RPUSH HSET  asynq:{q}:t:<id> :scheduled|:retry :pending
//	  delete-finished script ZREM DEL  asynq:{q}:archived|:completed, asynq:{q}:t:<id>
//	  task states            HGET asynq:{q}:t:<id> state, pipelined over many queues
//	  live servers           ZRANGEBYSCORE asynq:workers, then HEXISTS
//	                         asynq:workers:{<host:pid:server>} <id>, pipelined
//	  queue registry         SADD asynq:queues <queue>…  (one key)
//	cli                      PING
//
// Dead-letter replay and discard and cancelling a job (packages idempotency
// and tasks, the dashboard, keel dead and keel cancel) go through asynq's
// Inspector, one queue per call.
package scaleout
