// Package flow limits how many jobs of a kind run at once and how fast they
// start, across every worker that shares a Redis: "at most 5 report:generate
// at once", "the mail API: 50 calls a second". A job that may not start yet
// is postponed with retry.Wait, which does not use up one of its attempts.
//
// A Rule names the limit and the kinds it applies to; several kinds naming
// one rule share it. A Controller enforces the rules. Its Middleware admits
// jobs by kind; Take and Acquire apply a rule from inside a handler, to a
// resource rather than a kind:
//
//	limits, err := flow.New(flow.Config{Redis: redisOpt, Rules: []flow.Rule{
//		{Name: "reports", Kinds: []string{"report:generate", "report:export"}, Concurrency: 5},
//		{Name: "mail", Rate: 50, Period: time.Second},
//	}})
//	if err != nil { … }
//	defer limits.Close() // after the worker has stopped
//
//	srv, err := server.New(server.Config{
//		Redis: redisOpt, Pool: pool,
//		Middleware: []func(asynq.Handler) asynq.Handler{limits.Middleware},
//	}, mux)
//
//	// in a handler, right before calling the mail API
//	if err := limits.Take(ctx, "mail"); err != nil {
//		return err // the job comes back when a start is due
//	}
//
// # How
//
// A concurrency limit is a sorted set in Redis: one member per running job,
// scored with its lease's expiry. A Lua script drops expired members and
// adds one if fewer than the limit remain; the lease (Config.Lease, 30s) is
// renewed every third of itself while the handler runs and the member is
// removed when it returns (if Redis refuses, as during a failover, again
// and again until it answers or the lease ends), so a killed worker's slot
// comes back when its lease ends. A rate is GCRA in one Lua script: Redis keeps the time the
// next start is due, so the limit holds for any number of workers with no
// counters to reset. Both read the time from Redis, never a worker's clock.
//
// A job that cannot start waits in the worker for up to Config.Hold (1s),
// polling for a slot or sleeping until its reserved start, and is then
// postponed: by Config.Recheck (2s, jittered) for a slot, or until a start
// would be due for a rate. asynq returns postponed tasks to their queue at
// its DelayedTaskCheckInterval (5s by default), which bounds how quickly a
// postponed job is seen again.
//
// A limit is never exceeded while Redis answers: a rate start reserved and
// then not used, or a handler that ends early, only leaves it under-used.
// If Redis is out of reach for longer than a lease, the running job goes on
// and its slot may be given to another (counted in Stats.LeasesLost). If
// Redis loses its data (a restart without persistence, a failover, a
// flush), new jobs may take the slots until the holders' next renewal (a
// third of the lease) adds theirs back while there is room; a holder that
// finds them full then counts its lease lost, and the limit stays exceeded
// until the jobs end.
package flow
