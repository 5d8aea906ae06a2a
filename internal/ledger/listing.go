package ledger

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// JobFilter selects the jobs ListJobs reads; a zero field selects every
// job.
type JobFilter struct {
	Status Status // one status
	// InDoubt: jobs waiting on a person's verdict about a step (a step
	// started and never recorded done, which no Verify can settle, on a
	// job that is not running), or dead jobs whose error says they are in
	// doubt. Status is ignored.
	InDoubt bool
	Kind    string
	Queue   string
	Prefix  string // of the business key
	Error   string // a piece of the last error, in any case
	Batch   string // a batch's members only
	Oldest  bool   // oldest first; default newest first
	After   string // keyset cursor: the last id of the previous page
}

// ListedJob is what the dashboard's jobs list shows of a job.
type ListedJob struct {
	ID, Kind, BusinessKey, Queue string
	Status                       Status
	Attempts, MaxRetry           int
	LastError, ErrorClass        string
	CreatedAt, UpdatedAt         time.Time
	FinishedAt                   *time.Time
	// Superseded: a newer job of the key took this finished one's place
	// (its BusinessKey is the stored one, with the suffix).
	Superseded bool
}

// ListJobs reads a page of limit jobs, newest (or oldest) job id first —
// keel's job ids are time-ordered — after the cursor, and tells whether
// another page follows (it reads one row more than the page).
//
// Plans: with no status, or an open one (pending, running, failed), the
// scan walks the primary key (or keel_jobs_open) in id order and stops
// after the page, as it does for a status of many rows (dead, succeeded);
// dead, succeeded and discarded can read the partial indexes keel_jobs_dead
// and keel_jobs_finished_kind when their rows are few; kind with a business-key
// prefix uses the (kind, business_key) unique index.
func ListJobs(ctx context.Context, db DB, f JobFilter, limit int) ([]ListedJob, bool, error) {
	sql, args := listJobsSQL(f, limit)
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, false, err
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ListedJob, error) {
		var l ListedJob
		err := r.Scan(&l.ID, &l.Kind, &l.BusinessKey, &l.Queue, &l.Status, &l.Attempts, &l.MaxRetry,
			&l.LastError, &l.ErrorClass, &l.CreatedAt, &l.UpdatedAt, &l.FinishedAt, &l.Superseded)
		return l, err
	})
	if err != nil {
		return nil, false, err
	}
	more := len(out) > limit
	if more {
		out = out[:limit]
	}
	return out, more, nil
}

// listJobsSQL is ListJobs' statement for f, and its arguments.
func listJobsSQL(f JobFilter, limit int) (string, []any) {
	var conds []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	switch {
	case f.InDoubt:
		// Any job not running: a started step of a running one is a call in
		// progress, and a succeeded or discarded one has none in doubt left.
		conds = append(conds, `j.status IN ('pending', 'failed', 'dead', 'paused', 'cancelled') AND (EXISTS (SELECT 1 FROM keel_steps s
			WHERE s.job_id = j.id AND s.status = 'started' AND NOT s.verifiable) OR (j.status = 'dead' AND j.in_doubt))`)
	case f.Status != "":
		conds = append(conds, "j.status = "+arg(f.Status))
	}
	if f.Kind != "" {
		conds = append(conds, "j.kind = "+arg(f.Kind))
	}
	if f.Queue != "" {
		conds = append(conds, "j.queue = "+arg(f.Queue))
	}
	if f.Prefix != "" {
		p := arg(f.Prefix)
		conds = append(conds, "left(j.business_key, char_length("+p+")) = "+p)
	}
	if f.Error != "" {
		conds = append(conds, "position(lower("+arg(f.Error)+") in lower(coalesce(j.last_error, ''))) > 0")
	}
	if f.Batch != "" {
		conds = append(conds, "j.batch_id = "+arg(f.Batch)) // keel_jobs_batch
	}
	order := "DESC"
	if f.After != "" {
		op := "<"
		if f.Oldest {
			op = ">"
		}
		conds = append(conds, "j.id "+op+" "+arg(f.After))
	}
	if f.Oldest {
		order = "ASC"
	}
	where := ""
	if len(conds) > 0 {
		where = "WHERE " + strings.Join(conds, " AND ")
	}
	return `SELECT j.id, j.kind, j.business_key, j.queue, j.status, j.attempts, j.max_retry,
		coalesce(j.last_error, ''), coalesce(j.error_class, ''), j.created_at, j.updated_at, j.finished_at,
		j.superseded_at IS NOT NULL
		FROM keel_jobs j ` + where + ` ORDER BY j.id ` + order + ` LIMIT ` + arg(limit+1), args
}
