package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cron entries a person added at run time (keel_schedule_entries), paused
// entries (keel_schedule_pauses), and what schedulers say each entry they
// run is (keel_schedule's spec, timezone, kind, seen_at): migration 0027.

// ScheduleEntry is a cron entry added at run time.
type ScheduleEntry struct {
	Name, Spec, TimeZone, Kind string
	Payload                    []byte
	Queue                      string
	MaxRetry                   *int
	TimeoutMS                  int64
	CreatedAt                  time.Time
	CreatedBy                  string
	UpdatedAt                  time.Time
	UpdatedBy                  string
}

// addScheduleEntrySQL adds the entry unless one of its name exists, and
// forgets any keel_schedule row of the name (an entry removed before): the
// new entry starts afresh, with no ticks to catch up.
const addScheduleEntrySQL = `WITH a AS (INSERT INTO keel_schedule_entries
	(name, spec, timezone, kind, payload, queue, max_retry, timeout_ms, created_by, updated_by)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9)
	ON CONFLICT (name) DO NOTHING RETURNING name),
f AS (DELETE FROM keel_schedule WHERE entry IN (SELECT name FROM a))
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'add-schedule:' || name, $9, $10 FROM a`

// AddScheduleEntry adds e, audited, and reports false (and changes
// nothing) when an entry of its name exists.
func AddScheduleEntry(ctx context.Context, db DB, e ScheduleEntry, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, addScheduleEntrySQL, e.Name, e.Spec, e.TimeZone, e.Kind, e.Payload, e.Queue, e.MaxRetry, e.TimeoutMS, actor, note)
	return tag.RowsAffected() == 1, err
}

const updateScheduleEntrySQL = `WITH u AS (UPDATE keel_schedule_entries SET spec = $2, timezone = $3, kind = $4,
	payload = $5, queue = $6, max_retry = $7, timeout_ms = $8, updated_by = $9, updated_at = now()
	WHERE name = $1 RETURNING name)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'set-schedule:' || name, $9, $10 FROM u`

// UpdateScheduleEntry replaces the run-time entry named e.Name with e,
// audited, and reports false when there is none.
func UpdateScheduleEntry(ctx context.Context, db DB, e ScheduleEntry, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, updateScheduleEntrySQL, e.Name, e.Spec, e.TimeZone, e.Kind, e.Payload, e.Queue, e.MaxRetry, e.TimeoutMS, actor, note)
	return tag.RowsAffected() == 1, err
}

// removeScheduleEntrySQL deletes the entry with its pause and its
// keel_schedule row, audited.
const removeScheduleEntrySQL = `WITH d AS (DELETE FROM keel_schedule_entries WHERE name = $1 RETURNING name),
p AS (DELETE FROM keel_schedule_pauses WHERE entry IN (SELECT name FROM d)),
s AS (DELETE FROM keel_schedule WHERE entry IN (SELECT name FROM d))
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'remove-schedule:' || name, $2, $3 FROM d`

// RemoveScheduleEntry deletes the run-time entry name, and reports false
// when there is none.
func RemoveScheduleEntry(ctx context.Context, db DB, name, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, removeScheduleEntrySQL, name, actor, note)
	return tag.RowsAffected() == 1, err
}

const scheduleEntriesSQL = `SELECT name, spec, timezone, kind, payload, queue, max_retry, timeout_ms,
	created_at, created_by, updated_at, updated_by FROM keel_schedule_entries ORDER BY name`

// ScheduleEntries returns the run-time entries, by name.
func ScheduleEntries(ctx context.Context, db DB) ([]ScheduleEntry, error) {
	rows, err := db.Query(ctx, scheduleEntriesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[ScheduleEntry])
}

// SchedulePause is a cron entry a person paused.
type SchedulePause struct {
	Entry    string
	PausedAt time.Time
	PausedBy string
	Note     string
}

const pauseScheduleSQL = `WITH p AS (INSERT INTO keel_schedule_pauses (entry, paused_by, note) VALUES ($1, $2, $3)
	ON CONFLICT (entry) DO NOTHING RETURNING entry)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'pause-schedule:' || entry, $2, $3 FROM p`

// PauseSchedule records entry as paused by actor, and reports whether it
// was not already.
func PauseSchedule(ctx context.Context, db DB, entry, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, pauseScheduleSQL, entry, actor, note)
	return tag.RowsAffected() == 1, err
}

const resumeScheduleSQL = `WITH r AS (DELETE FROM keel_schedule_pauses WHERE entry = $1 RETURNING entry)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'resume-schedule:' || entry, $2, $3 FROM r`

// ResumeSchedule deletes entry's pause, and reports whether there was one.
func ResumeSchedule(ctx context.Context, db DB, entry, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, resumeScheduleSQL, entry, actor, note)
	return tag.RowsAffected() == 1, err
}

const schedulePausesSQL = `SELECT entry, paused_at, paused_by, note FROM keel_schedule_pauses ORDER BY entry`

// SchedulePauses returns the paused entries, by name.
func SchedulePauses(ctx context.Context, db DB) ([]SchedulePause, error) {
	rows, err := db.Query(ctx, schedulePausesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[SchedulePause])
}

// ScheduleState is an entry's keel_schedule row: its newest tick handled,
// and what the schedulers running it last said it is (Spec nil from an
// older scheduler).
type ScheduleState struct {
	Entry    string
	LastTick time.Time
	Spec     *string
	TimeZone string
	Kind     *string
	SeenAt   *time.Time
}

const scheduleStatesSQL = `SELECT entry, last_tick, spec, timezone, kind, seen_at FROM keel_schedule ORDER BY entry`

// ScheduleStates returns every keel_schedule row, by entry.
func ScheduleStates(ctx context.Context, db DB) ([]ScheduleState, error) {
	rows, err := db.Query(ctx, scheduleStatesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[ScheduleState])
}

// describeScheduleSQL writes only what changed, or seen_at once it is a
// minute old: a scheduler calls it every poll. An entry whose recorded
// spec or time zone changed starts afresh, as the scheduler that changed
// it did (last_tick moves up to its clock's now, $5): a scheduler started
// later would otherwise catch up the new schedule's ticks from before it.
const describeScheduleSQL = `UPDATE keel_schedule s SET spec = d.spec, timezone = d.timezone, kind = d.kind, seen_at = now(),
	last_tick = CASE WHEN s.spec IS NOT NULL AND (s.spec <> d.spec OR s.timezone <> d.timezone)
		THEN greatest(s.last_tick, $5) ELSE s.last_tick END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS d (entry, spec, timezone, kind)
WHERE s.entry = d.entry AND (s.spec IS DISTINCT FROM d.spec OR s.timezone <> d.timezone OR s.kind IS DISTINCT FROM d.kind
	OR s.seen_at IS NULL OR s.seen_at < now() - interval '1 minute')`

// DescribeSchedule records what the entries a scheduler runs are, in the
// rows keel_schedule has for them, and returns how many rows it wrote; an
// entry whose schedule changed is handled up to now, the scheduler's clock.
func DescribeSchedule(ctx context.Context, db DB, entries, specs, zones, kinds []string, now time.Time) (int64, error) {
	tag, err := db.Exec(ctx, describeScheduleSQL, entries, specs, zones, kinds, now)
	return tag.RowsAffected(), err
}

// TickJob is the job a cron tick made.
type TickJob struct {
	Kind, BusinessKey, ID string
	Status                Status
}

const tickJobsSQL = `SELECT j.kind, j.business_key, j.id, j.status FROM keel_jobs j
JOIN unnest($1::text[], $2::text[]) AS t (kind, business_key) ON j.kind = t.kind AND j.business_key = t.business_key`

// TickJobs returns the jobs of the given (kinds[i], keys[i]) pairs that
// exist.
func TickJobs(ctx context.Context, db DB, kinds, keys []string) ([]TickJob, error) {
	rows, err := db.Query(ctx, tickJobsSQL, kinds, keys)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[TickJob])
}

// ScheduleRow is a cron entry as the ledger knows it, for the metrics: a
// run-time entry, or one a scheduler described from its file or code.
type ScheduleRow struct {
	Entry, Spec, TimeZone string
	// RunTime: added at run time (keel_schedule_entries); otherwise a
	// file's or code's, as a scheduler described it.
	RunTime, Paused bool
	// Since is the newest tick handled, or when the run-time entry was
	// added or last changed if later: its next tick after Since is due.
	Since time.Time
	// SeenAt is when a scheduler last said it runs the entry (nil: none).
	SeenAt *time.Time
	// Now is the ledger's clock, which wrote the other times.
	Now time.Time
}

// scheduleRowsSQL reads the run-time entries and the described ones
// (those with a spec), with their pauses: three small tables, whole.
const scheduleRowsSQL = `SELECT coalesce(e.name, s.entry), coalesce(e.spec, s.spec),
	CASE WHEN e.name IS NOT NULL THEN e.timezone ELSE s.timezone END,
	e.name IS NOT NULL, p.entry IS NOT NULL,
	greatest(s.last_tick, e.created_at, e.updated_at), s.seen_at, now()
	FROM keel_schedule_entries e FULL JOIN keel_schedule s ON s.entry = e.name
	LEFT JOIN keel_schedule_pauses p ON p.entry = coalesce(e.name, s.entry)
	WHERE e.name IS NOT NULL OR s.spec IS NOT NULL
	ORDER BY 1`

// ScheduleRows returns every cron entry the ledger knows the spec of, by
// name.
func ScheduleRows(ctx context.Context, db DB) ([]ScheduleRow, error) {
	rows, err := db.Query(ctx, scheduleRowsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[ScheduleRow])
}
