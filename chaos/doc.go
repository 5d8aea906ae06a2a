// Package chaos holds keel's chaos soak: a test that runs a realistic mix of
// jobs through several worker processes while it kills them, empties Redis
// and (optionally) restarts Postgres, and then checks that the ledger's
// promises held. The package has no API; everything is in its tests.
//
// # What runs
//
// The test binary starts three copies of itself as worker processes (each a
// server.New worker with its own relay and reconciler, short reconciler
// interval and grace, a 3 s ledger lease, a 1 s timeout grace, a 3 s
// shutdown timeout, retries backing off 1 s to 3 s and a flow rate limit), a
// stand-alone relay, a scheduler with an "@every 1s" entry and a fake
// external service in the test process, and a private redis-server. It then
// submits jobs of eight kinds, half with Enqueue and half with EnqueueTx
// inside a transaction that also writes a business row, every tenth twice:
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
//     the middle of the call parks the job as "in doubt" for a person;
//   - external, raw errors: a charge over HTTP to a fake service that is not
//     idempotent (it applies every request it receives and counts them per
//     key), through a plain client whose errors reach idempotency.Step
//     unmarked. The service hangs up after applying a tenth of the charges,
//     answers another tenth after the client's timeout, and hangs up without
//     applying a tenth: to the client all three are the same transport
//     error. Step must hold them in doubt and let Verify (a look-up on the
//     service) decide, never send again blindly.
//
// and a few jobs of rarer kinds, spread over the run:
//
//   - poison (MaxRetry 1): its handler calls os.Exit, killing the worker;
//     the parent starts a killed worker again, as a supervisor would. It
//     must end dead with class crashed after two runs;
//   - hung (MaxRetry 2, timeout 1 s): its handler ignores its context until
//     the ledger shows keel gave the run up, then tries a recorded step and
//     the completing InTx anyway. Half hang on every attempt and must end
//     dead with class timeout, half on their first only and must succeed;
//   - deploy (MaxRetry 0): runs 4-6 s, longer than the shutdown timeout.
//     Workers running them are sent SIGTERM and started again: a run cut
//     short so must not use the job's one attempt.
//
// and jobs where keel's guarantees meet each other, also spread over the
// run:
//
//   - deadline (tasks.Deadline) and expiring (the same with
//     tasks.ExpireAtDeadline): half are delayed until 200 ms before their
//     deadline, so the scheduled-task check and the queue make them wait
//     past it, half are due 10 s out and run; a run asks for a retry a
//     minute later (retry.After), past the deadline. Every deadline job
//     must end dead with class deadline, alerted, every expiring one
//     discarded with class expired and no alert — never stuck open, never
//     run after its deadline (each run records its start). A third of them
//     are in a batch of their own, whose callback must run once. Before
//     each, an enqueue with a Delay past its deadline must be refused with
//     idempotency.ErrPastDeadline;
//   - late call (Timeout 1 s): its step's client ignores its context and,
//     on the first attempt, reaches the fake service only once a later run
//     has decided about the step, long after keel gave the first run up. The
//     service applies every call it receives; the next attempt must wait
//     while the call is in flight
//     (idempotency.ErrCallInFlight, no attempt spent) and then skip the
//     step: one call received per job. (A kill or a deploy that cuts the
//     call off before it is sent leaves Verify to find nothing and a later
//     attempt to call, promptly.);
//   - Unique (tasks.Unique of 1 ms, MaxRetry 0): a key's first job acts
//     for 4 s whatever its context says; the driver cancels it
//     (Client.Cancel) once it runs, or keel gives it up at its 1 s
//     timeout. Once it has ended, the window has passed and the driver
//     enqueues the key again: a new job, which must not start while the
//     first job's handler acts. Each run records its start and, as it
//     goes, its last moment seen acting (clock_timestamp()), and no two
//     intervals of a key may overlap;
//   - deploy-committed (MaxRetry 0): commits its effect with the completing
//     InTx, then runs on 8-12 s and returns the context's error when a
//     deploy cuts it short. It must succeed: no dead letter, no alert;
//   - long: 3-4.5 s each, arriving all through the submissions, so that
//     no worker is ever idle;
//   - crash-once (MaxRetry 1, timeout 10 s): its first attempt kills its
//     worker (os.Exit), so its last run must run alone — beside long jobs
//     that outlast its wait for room (2 s, a fifth of its timeout), so it
//     is handed back and its worker drains for it. It must succeed, not
//     die waited_too_long or crashed.
//
// While jobs run, a worker is killed with SIGKILL and restarted, workers
// are sent SIGTERM (a deploy: the worker running the most deploy jobs, or
// deploy-committed ones past their commit) and started again once
// stopped, and Redis is
// stopped and started again empty. A kill aims at a worker in the middle of
// an external call when there is one, alternately an unverified and a
// verified one, so that runs do cut recorded steps short. The run ends when
// every job is terminal (succeeded, dead, discarded, or cancelled: a
// Unique key's first job).
//
// # What it proves
//
// The final check prints a table and asserts, over every accepted submission
// (Enqueue returned nil, or the transaction that called EnqueueTx committed):
//
//   - jobs lost: 0 — every business key has a ledger row that is succeeded
//     or dead, or discarded as expired (an expiring deadline job);
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
//   - the scheduler made exactly one job per tick, with no tick missing;
//   - the fake service applied no charge twice (per key, counted where it
//     receives them), and every succeeded raw-error job was charged once;
//   - every poison job is dead with class crashed, within its budget of runs;
//   - every hung job ended by its budget: dead with class timeout (or
//     crashed, when a kill cut its last run), or succeeded if it hung once;
//     every late step and InTx of a given-up run was refused
//     (idempotency.ErrRunGivenUp, or ErrLeaseLost) and made no call;
//   - no MaxRetry(0) job died of anything but a crash: a deploy costs no
//     attempt, and one that cuts a run short after its completing InTx
//     makes a success (one whose only run a SIGKILL or a poison job cut
//     short is dead, crashed, and counted apart);
//   - every deadline job ended dead (deadline) and every expiring one
//     discarded (expired), none ran after its deadline, every enqueue past
//     a deadline was refused and wrote no job;
//   - every late-call job received exactly one call at the service;
//   - every Unique key's second enqueue made a new job, which succeeded,
//     its first job ended cancelled or dead (timeout), and no two runs of
//     the key overlapped;
//   - every crash-once job succeeded;
//   - alerts (GuardConfig.OnDead, recorded by the workers) came only for
//     jobs that are dead, and every deadline death had one: none for a
//     deploy, an expired job or a success;
//   - each of these faults did happen: a poison job killed a worker, a hung
//     run was given up, a deploy cut a job short that then finished without
//     using an attempt, the service left charges unanswered and a Verify
//     found one missing, deadline jobs ended both without a run and after
//     one, a late-call job waited for a call in flight, a Unique key's
//     second job came while its first job's handler still acted, a deploy
//     cut a job short after its commit, and a crash-once job crashed its
//     worker and then succeeded. Otherwise the checks above prove nothing
//     and the run fails.
//
// keel's rescuer hands a dead worker's jobs back once their ledger lease
// (3 s here) has run out, so a run usually converges within seconds of its
// last fault; a job whose asynq copy is still active on a dead worker while
// its ledger row is not running waits for asynq's own recoverer (30 s task
// lease, once a minute), which can add about a minute.
//
// # Running it
//
// The short version is an ordinary test, run by CI with the rest (and
// skipped by -short): 2,000 jobs plus 38 of the rare kinds and 111 of the
// joints' (16 deadline, 6 late-call, 6 Unique, 20 deploy-committed, 60
// long, 3 crash-once), one SIGKILL, two deploys, one Redis restart and the
// poison and crash-once jobs' seven worker deaths; about 50 to 120 s on two
// cores, depending on whether asynq's recoverer is needed and on how long
// the runs that must run alone after a crash wait for room.
//
//	go test -race -count=1 -v -run TestChaosShort ./chaos
//
// The long version needs the chaos build tag: 20,000 jobs plus 240 of the
// rare kinds and 852 of the joints' (80 deadline, 30 late-call, 30 Unique,
// 100 deploy-committed, 600 long, 12 crash-once), a worker killed every
// 10 s for five minutes and a deploy every 30 s for seven (the backlog
// holds the last deploy jobs that long), Redis emptied twice; about
// 8 to 9 minutes on two cores, and it fails if not done within 20.
//
//	go test -tags chaos -run TestChaosLong -timeout 30m -v ./chaos
//
// The batches variant needs the chaos build tag too: the short soak with
// every job in one of 24 batches (each of one class, so some end all
// succeeded and some with dead members), sealed once the submissions are
// done (a third of the deadline jobs are in a batch of their own instead,
// as in every version). Each batch must complete once (generation 1), its counters must
// equal its members' statuses in the ledger, its on_complete callback must
// run once with those counts and its on_success once exactly when every
// member succeeded.
//
//	go test -tags chaos -run TestChaosBatches -timeout 10m -v ./chaos
//
// The workflows variant (chaos build tag) is the short soak with 60
// workflows of five dependent jobs (a fan-out, a fan-in and a tail) among
// its jobs: every workflow job must succeed once (one committed effect),
// none may start before each of its parents has succeeded, none may be
// left waiting, and none may be lost.
//
//	go test -tags chaos -run TestChaosWorkflows -timeout 10m -v ./chaos
//
// All of them use the test Redis and Postgres of the other packages' tests
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
