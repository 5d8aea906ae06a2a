// Package chaos holds keel's chaos soak: a test that runs a realistic mix of
// jobs through several worker processes while it kills them, empties Redis
// and (optionally) restarts Postgres, and then checks that the ledger's
// promises held. The package has no API; everything is in its tests.
//
// # What runs
//
// The test binary starts three copies of itself as worker processes (each a
// server.New worker with its own relay and reconciler, short reconciler
// interval and grace, a 3 s ledger lease, retries backing off 1 s to 3 s and
// a flow rate limit), a stand-alone relay and a scheduler with an "@every 1s"
// entry in the test process, and a private redis-server. It then submits jobs
// of seven kinds, half with Enqueue and half with EnqueueTx inside a
// transaction that also writes a business row, every tenth twice:
//
//   - succeeding: a local effect written with idempotency.InTx into a table
//     whose primary key is the business key, so a second effect fails loudly;
//   - transient: fails its first one or two attempts with retry.Transient;
//   - permanent: fails with retry.Permanent and must end dead with a reason;
//   - rate-limited: 200 starts/s through package flow, and postponed with
//     retry.Wait on its first three runs, which must not use up attempts;
//   - slow: sleeps 200-500 ms before its effect;
//   - external: calls a fake payment service (it records every call per
//     idempotency key) inside idempotency.Step with a Verify that asks it;
//   - external, unverified: the same without Verify, so a worker killed in
//     the middle of the call parks the job as "in doubt" for a person.
//
// While jobs run, a worker is killed with SIGKILL and restarted, and Redis is
// stopped and started again empty. A kill aims at a worker in the middle of
// an external call when there is one, alternately an unverified and a
// verified one, so that runs do cut recorded steps short. The run ends when
// every job is terminal.
//
// # What it proves
//
// The final check prints a table and asserts, over every accepted submission
// (Enqueue returned nil, or the transaction that called EnqueueTx committed):
//
//   - jobs lost: 0 — every business key has a ledger row that is succeeded
//     or dead;
//   - side effects duplicated: 0 — local effects at most once per key (the
//     handlers also count unique violations), external calls at most once per
//     step key; steps parked in doubt count as dead, not duplicated;
//   - every job ended as its kind predicts: permanent ones dead, the others
//     succeeded, except unverified external calls cut by a kill, which are
//     dead "in doubt" and counted apart;
//   - a succeeded job left exactly one effect (and one external call), a dead
//     one none, and every dead job has a last error and an error class;
//   - duplicate submissions returned the existing job, business rows written
//     with EnqueueTx all have their job, waits did not count as attempts;
//   - the scheduler made exactly one job per tick, with no tick missing.
//
// asynq recovers a killed worker's active tasks only after its 30 s task
// lease and the next run of its once-a-minute recoverer, so a run lasts at
// least about 100 s after its last kill.
//
// # Running it
//
// The short version is an ordinary test, run by CI with the rest (and
// skipped by -short): 2,000 jobs, one SIGKILL and one Redis restart, about
// 90 s on two cores, most of it waiting for asynq's crash recovery.
//
//	go test -race -count=1 -v -run TestChaosShort ./chaos
//
// The long version needs the chaos build tag: 20,000 jobs, a worker killed
// every 10 s for five minutes, Redis emptied twice; about 7 minutes on two
// cores, and it fails if not done within 20.
//
//	go test -tags chaos -run TestChaosLong -timeout 30m -v ./chaos
//
// Both use the test Redis and Postgres of the other packages' tests
// (KEEL_TEST_DATABASE_URL), in their own schema and a private redis-server.
// The long version is meant to restart Postgres as well, which must never
// happen to a database other tests share: give it a dedicated server with
// KEEL_CHAOS_DATABASE_URL and a shell command that restarts that server with
// KEEL_CHAOS_PG_RESTART_CMD, for example
//
//	KEEL_CHAOS_DATABASE_URL=postgres://postgres@127.0.0.1:5433/keel_chaos?sslmode=disable \
//	KEEL_CHAOS_PG_RESTART_CMD='docker restart keel-chaos-pg' \
//	go test -tags chaos -run TestChaosLong -timeout 30m -v ./chaos
//
// Without KEEL_CHAOS_PG_RESTART_CMD Postgres is never restarted; with it and
// without KEEL_CHAOS_DATABASE_URL the test refuses to run. The workers' logs
// (warnings and errors) go to a temporary directory, shown in part when the
// test fails; KEEL_CHAOS_LOG_DIR keeps them in a directory of your choice.
package chaos
