package ledger

import "context"

// The statements of a handler's steps (keel_steps): a step's start, its
// outcome, and a later run's look at a step an earlier run started. Each
// writes only while the run (holder, run number) still holds its job, or
// the step.

// StepRun names a step of a job and the run of it at work.
type StepRun struct {
	JobID, Name, Holder string
	Run                 int
}

func (r StepRun) args(more ...any) []any {
	return append([]any{r.JobID, r.Name, r.Holder, r.Run}, more...)
}

// stepLeaseHeld is the condition, on $1 job id, $3 holder and $4 run,
// that this run still holds the job: its lease has not run out either, so
// a worker paused past it (a long GC pause, SIGSTOP, a frozen VM) that
// wakes up does not send, even before another worker took the job over.
const stepLeaseHeld = `EXISTS (SELECT 1 FROM keel_jobs WHERE id = $1 AND status = 'running' AND lease_holder = $3 AND run = $4
	AND lease_until > now())`

// stepHeld is the condition, on $3 holder and $4 run, that this run holds
// the step (of the row the statement updates): it started the step or
// took it over. Only that run writes the step's outcome.
const stepHeld = `run = $4 AND call_holder = $3`

// startStepSQL records the step started by this run, its call in flight
// for $6 ms, where the run holds its job; it says whether it held it and
// whether the step is new.
const startStepSQL = `WITH lease AS (
			SELECT 1 FROM keel_jobs WHERE id = $1 AND status = 'running' AND lease_holder = $3 AND run = $4 AND lease_until > now()),
		ins AS (
			INSERT INTO keel_steps (job_id, name, status, verifiable, run, call_holder, call_until)
			SELECT $1, $2, 'started', $5, $4, $3, now() + $6 * interval '1 millisecond' FROM lease
			ON CONFLICT (job_id, name) DO NOTHING RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM lease), EXISTS (SELECT 1 FROM ins)`

// StartStep records r's step started (committed on its own, before the
// call); fresh false: an earlier run started it.
func StartStep(ctx context.Context, db DB, r StepRun, verifiable bool, leaseMS int64) (leased, fresh bool, err error) {
	err = db.QueryRow(ctx, startStepSQL, r.args(verifiable, leaseMS)...).Scan(&leased, &fresh)
	return leased, fresh, err
}

const readStepSQL = `SELECT status, result, coalesce(call_until > now(), false),
			coalesce((extract(epoch FROM call_until - now()) * 1000)::bigint, 0)
		FROM keel_steps WHERE job_id = $1 AND name = $2`

// StepState is a started step as a later run finds it.
type StepState struct {
	Status string // started, done
	Result []byte
	// InFlight: a run's call of it may still be under way, for LeftMS.
	InFlight bool
	LeftMS   int64
}

// ReadStep reads step name of job jobID.
func ReadStep(ctx context.Context, db DB, jobID, name string) (StepState, error) {
	var st StepState
	err := db.QueryRow(ctx, readStepSQL, jobID, name).Scan(&st.Status, &st.Result, &st.InFlight, &st.LeftMS)
	return st, err
}

const takeOverStepSQL = `WITH lease AS (SELECT 1 WHERE ` + stepLeaseHeld + `),
		took AS (UPDATE keel_steps SET run = $4, call_holder = $3
			WHERE job_id = $1 AND name = $2 AND status = 'started' AND (call_until IS NULL OR call_until <= now())
			AND EXISTS (SELECT 1 FROM lease) RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM lease), EXISTS (SELECT 1 FROM took)`

// TakeOverStep makes r's run the holder of a step in doubt no call is in
// flight for, before it asks Verify.
func TakeOverStep(ctx context.Context, db DB, r StepRun) (leased, taken bool, err error) {
	err = db.QueryRow(ctx, takeOverStepSQL, r.args()...).Scan(&leased, &taken)
	return leased, taken, err
}

const stepVerifiedSQL = `UPDATE keel_steps SET status = 'done', finished_at = now()
			WHERE job_id = $1 AND name = $2 AND ` + stepHeld + ` AND ` + stepLeaseHeld

// StepVerified records the step done, as Verify found it; false: the run
// no longer holds it.
func StepVerified(ctx context.Context, db DB, r StepRun) (bool, error) {
	tag, err := db.Exec(ctx, stepVerifiedSQL, r.args()...)
	return tag.RowsAffected() > 0, err
}

const callStepAgainSQL = `UPDATE keel_steps SET calls = calls + 1, started_at = now(), verifiable = true,
			call_until = now() + $5 * interval '1 millisecond'
		WHERE job_id = $1 AND name = $2 AND ` + stepHeld + ` AND ` + stepLeaseHeld

// CallStepAgain records another call of a step Verify found not done.
func CallStepAgain(ctx context.Context, db DB, r StepRun, leaseMS int64) (bool, error) {
	tag, err := db.Exec(ctx, callStepAgainSQL, r.args(leaseMS)...)
	return tag.RowsAffected() > 0, err
}

const forgetStepSQL = `DELETE FROM keel_steps WHERE job_id = $1 AND name = $2 AND status = 'started'
				AND ` + stepHeld

// ForgetStep removes the start of a step whose call never took effect.
func ForgetStep(ctx context.Context, db DB, r StepRun) error {
	_, err := db.Exec(ctx, forgetStepSQL, r.args()...)
	return err
}

const stepLandedSQL = `UPDATE keel_steps SET call_until = NULL
			WHERE job_id = $1 AND name = $2 AND status = 'started' AND ` + stepHeld

// StepLanded records that a step's call in doubt is no longer in flight.
func StepLanded(ctx context.Context, db DB, r StepRun) error {
	_, err := db.Exec(ctx, stepLandedSQL, r.args()...)
	return err
}

const stepDoneSQL = `UPDATE keel_steps SET status = 'done', result = $5, finished_at = now(), call_until = NULL
		WHERE job_id = $1 AND name = $2 AND status = 'started' AND ` + stepHeld

// StepDone records a step's call done with its result; false: the run no
// longer holds the step.
func StepDone(ctx context.Context, db DB, r StepRun, result []byte) (bool, error) {
	tag, err := db.Exec(ctx, stepDoneSQL, r.args(result)...)
	return tag.RowsAffected() > 0, err
}

const stepNotVerifiableSQL = `UPDATE keel_steps SET verifiable = false
		WHERE job_id = $1 AND name = $2 AND status = 'started'`

// StepNotVerifiable records that a step in doubt is one no Verify can
// settle.
func StepNotVerifiable(ctx context.Context, db DB, jobID, name string) error {
	_, err := db.Exec(ctx, stepNotVerifiableSQL, jobID, name)
	return err
}
