package jobstore

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/ledger"
)

// Inserted is what InsertMany did with one NewJob.
type Inserted struct {
	// Job is the ledger row: the new one, or the one that already existed.
	Job Job
	// Existed is true when the row was there before this call, or when an
	// earlier job of the same call had the same (kind, business key).
	Existed bool
}

// InsertOptions say how InsertMany writes new rows.
type InsertOptions struct {
	// Claim writes new rows already marked published: the caller publishes
	// them itself once they commit and hands back with Unpublish any it
	// could not. A caller that dies in between leaves rows the reconciler
	// republishes after its grace, as it does for a relay that dies.
	Claim bool
	// WakeRelay makes sure a relay publishes new rows soon after commit, as
	// NewJob.WakeRelay does for Insert.
	WakeRelay bool
}

// Bounds of one InsertMany statement; bigger calls are split into several
// statements in one transaction.
const (
	InsertChunkRows  = 1000
	InsertChunkBytes = 8 << 20
)

type bulkKey struct{ kind, key string }

// InsertMany records jobs in db (a pool or the caller's transaction) and
// returns, in the order of jobs, each one's row and whether it existed.
// Jobs are deduplicated by (kind, business key), within the call too: the
// first of a key creates the row (unless the ledger holds it already), the
// others get the same row with Existed = true. Every job is checked before
// anything is written, so an invalid one fails the call with nothing
// written. The rows go in with one statement per InsertChunkRows rows (or
// InsertChunkBytes of payload); through a pool, a call of several chunks
// runs in a transaction of its own, so it is all or nothing either way.
func (s *Store) InsertMany(ctx context.Context, db DB, jobs []NewJob, opts InsertOptions) ([]Inserted, error) {
	for i, nj := range jobs {
		if err := ValidateNewJob(nj); err != nil {
			return nil, fmt.Errorf("keel: job %d (%s, key %q): %w", i, nj.Kind, nj.BusinessKey, err)
		}
	}
	// One row per key, in (kind, concurrency key, key) order: concurrent
	// calls with overlapping keys then take the unique index's locks, and
	// their concurrency keys' locks (see migration 0030), in the same order
	// and cannot deadlock.
	first := make(map[bulkKey]int, len(jobs))
	uniq := make([]int, 0, len(jobs))
	for i, nj := range jobs {
		k := bulkKey{nj.Kind, nj.BusinessKey}
		if _, ok := first[k]; !ok {
			first[k] = i
			uniq = append(uniq, i)
		}
	}
	slices.SortFunc(uniq, func(a, b int) int {
		return cmp.Or(cmp.Compare(jobs[a].Kind, jobs[b].Kind), cmp.Compare(jobs[a].ConcurrencyKey, jobs[b].ConcurrencyKey),
			cmp.Compare(jobs[a].BusinessKey, jobs[b].BusinessKey))
	})
	chunks := chunkJobs(jobs, uniq)
	var batches []string
	seen := map[string]bool{}
	for _, i := range uniq {
		if b := jobs[i].BatchID; b != "" && !seen[b] {
			seen[b] = true
			batches = append(batches, b)
		}
	}
	got := make(map[bulkKey]Inserted, len(uniq))
	windowed := slices.ContainsFunc(jobs, func(nj NewJob) bool { return nj.UniqueWindow > 0 })
	run := func(db DB) error {
		for _, c := range chunks {
			if windowed {
				if err := supersedeChunk(ctx, db, jobs, c); err != nil {
					return err
				}
			}
			if err := s.insertChunk(ctx, db, jobs, c, batches, opts, got); err != nil {
				return err
			}
		}
		return nil
	}
	var err error
	if p, ok := db.(*pgxpool.Pool); ok && (len(chunks) > 1 || windowed) {
		err = pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error { return run(tx) })
	} else {
		err = run(db)
	}
	if err != nil {
		return nil, err
	}
	out := make([]Inserted, len(jobs))
	for i, nj := range jobs {
		k := bulkKey{nj.Kind, nj.BusinessKey}
		out[i] = got[k]
		if first[k] != i {
			out[i].Existed = true
		}
	}
	return out, nil
}

// supersedeChunk moves aside the finished jobs, past their window, of the
// keys at idx (see supersedeSQL).
func supersedeChunk(ctx context.Context, db DB, jobs []NewJob, idx []int) error {
	var kinds, keys []string
	var windows []int64
	for _, i := range idx {
		if w := jobs[i].UniqueWindow; w > 0 {
			kinds, keys, windows = append(kinds, jobs[i].Kind), append(keys, jobs[i].BusinessKey), append(windows, w.Milliseconds())
		}
	}
	if len(kinds) == 0 {
		return nil
	}
	return supersede(ctx, db, kinds, keys, windows)
}

// ValidateNewJob is what Insert and InsertMany check of a job before they
// write anything: its kind and business key, UTF-8 text, its retry budget
// and trace context.
func ValidateNewJob(nj NewJob) error {
	if err := ledger.ValidateKey("kind", nj.Kind); err != nil {
		return err
	}
	if err := ledger.ValidateKey("business key", nj.BusinessKey); err != nil {
		return err
	}
	if nj.ConcurrencyKey != "" {
		if err := ledger.ValidateKey("concurrency key", nj.ConcurrencyKey); err != nil {
			return err
		}
		if nj.ConcurrencyLimit < 1 {
			return fmt.Errorf("concurrency limit %d is below 1", nj.ConcurrencyLimit)
		}
	}
	if !utf8.ValidString(nj.PayloadSummary) || !utf8.ValidString(nj.TraceID) {
		return fmt.Errorf("payload summary and trace id must be valid UTF-8")
	}
	if nj.MaxRetry < 0 || nj.MaxRetry > MaxRetryLimit {
		return fmt.Errorf("max retry %d is outside 0…%d", nj.MaxRetry, MaxRetryLimit)
	}
	runAt := nj.RunAt
	if runAt.IsZero() {
		runAt = time.Now()
	}
	if err := CheckRunAt(runAt, nj.Deadline); err != nil {
		return err
	}
	return validateTraceContext(nj)
}

// MaxRetryLimit is the largest retry budget a job can have: the ledger
// counts attempts in a 32-bit column, and asynq is given
// AsynqRetryHeadroom tries more.
const MaxRetryLimit = math.MaxInt32 - AsynqRetryHeadroom - 1

// chunkJobs splits the indexes in uniq into runs of at most InsertChunkRows
// jobs and, unless one job alone is bigger, InsertChunkBytes of payload.
func chunkJobs(jobs []NewJob, uniq []int) [][]int {
	var chunks [][]int
	start, bytes := 0, 0
	for n, i := range uniq {
		size := len(jobs[i].Payload) + len(jobs[i].BusinessKey)
		if n > start && (n-start == InsertChunkRows || bytes+size > InsertChunkBytes) {
			chunks = append(chunks, uniq[start:n])
			start, bytes = n, 0
		}
		bytes += size
	}
	if start < len(uniq) {
		chunks = append(chunks, uniq[start:])
	}
	return chunks
}

// insertChunk writes the jobs at idx and records in got the row of each
// (kind, key): the one it wrote, or the one that was there. Two tries, as
// in Insert: a conflicting row can vanish before it is read.
func (s *Store) insertChunk(ctx context.Context, db DB, jobs []NewJob, idx []int, batches []string, opts InsertOptions,
	got map[bulkKey]Inserted) error {
	for range 2 {
		if err := s.insertRows(ctx, db, jobs, idx, batches, opts, got); err != nil {
			return err
		}
		missing := idx[:0:0]
		for _, i := range idx {
			if _, ok := got[bulkKey{jobs[i].Kind, jobs[i].BusinessKey}]; !ok {
				missing = append(missing, i)
			}
		}
		if len(missing) == 0 {
			return nil
		}
		if err := lookupRows(ctx, db, jobs, missing, got); err != nil {
			return err
		}
		idx = idx[:0:0]
		for _, i := range missing {
			if _, ok := got[bulkKey{jobs[i].Kind, jobs[i].BusinessKey}]; !ok {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			return nil
		}
	}
	return fmt.Errorf("keel: could not insert or find job %s/%s", jobs[idx[0]].Kind, jobs[idx[0]].BusinessKey)
}

// insertRows writes the jobs at idx; batches are the batches of the whole
// call (see bulkInsertBatchSQL).
func (s *Store) insertRows(ctx context.Context, db DB, jobs []NewJob, idx []int, batches []string, opts InsertOptions,
	got map[bulkKey]Inserted) error {
	n := len(idx)
	var (
		ids, kinds, keys, queues = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		payloads                 = make([][]byte, n)
		maxRetry                 = make([]int32, n)
		timeouts, maxWaits       = make([]int64, n), make([]int64, n)
		deadlines, runAts        = make([]*time.Time, n), make([]*time.Time, n)
		summaries, traces        = make([]string, n), make([]string, n)
		rowBatches               = make([]string, n)
		expires                  = make([]bool, n)
	)
	for r, i := range idx {
		nj := jobs[i]
		id, err := uuid.NewV7()
		if err != nil {
			return err
		}
		ids[r], kinds[r], keys[r], queues[r] = id.String(), nj.Kind, nj.BusinessKey, nj.Queue
		payloads[r] = nj.Payload
		if payloads[r] == nil {
			payloads[r] = []byte{}
		}
		maxRetry[r] = int32(nj.MaxRetry)
		timeouts[r], maxWaits[r] = nj.Timeout.Milliseconds(), nj.MaxWait.Milliseconds()
		if !nj.Deadline.IsZero() {
			deadlines[r] = &nj.Deadline
		}
		if !nj.RunAt.IsZero() {
			runAts[r] = &nj.RunAt
		}
		summaries[r], traces[r], rowBatches[r] = nj.PayloadSummary, nj.TraceID, nj.BatchID
		expires[r] = nj.ExpireAtDeadline
	}
	parents, states := traceContexts(jobs, idx)
	ckeys, climits := concurrencyKeys(jobs, idx)
	at := make(map[string]int, n)
	for r, id := range ids {
		at[id] = idx[r]
	}
	err := ledger.InsertJobs(ctx, db, ledger.JobRows{IDs: ids, Kinds: kinds, Keys: keys, Queues: queues, Payloads: payloads,
		MaxRetry: maxRetry, Timeouts: timeouts, MaxWaits: maxWaits, Deadlines: deadlines, RunAts: runAts,
		Summaries: summaries, Traces: traces, TraceParents: parents, TraceStates: states, Batches: rowBatches, Expire: expires,
		ConcurrencyKeys: ckeys, ConcurrencyLimits: climits},
		opts.Claim, opts.WakeRelay, batches, func(row ledger.NewRow) {
			nj := jobs[at[row.ID]]
			got[bulkKey{nj.Kind, nj.BusinessKey}] = Inserted{Job: newJob(row, nj)}
		})
	return Interpret(err)
}

func lookupRows(ctx context.Context, db DB, jobs []NewJob, idx []int, got map[bulkKey]Inserted) error {
	kinds, keys := make([]string, len(idx)), make([]string, len(idx))
	for r, i := range idx {
		kinds[r], keys[r] = jobs[i].Kind, jobs[i].BusinessKey
	}
	return Interpret(ledger.LookupJobs(ctx, db, kinds, keys, func(j Job) {
		got[bulkKey{j.Kind, j.BusinessKey}] = Inserted{Job: j, Existed: true}
	}))
}

// concurrencyKeys are the concurrency keys and limits of the jobs at idx,
// or empty arrays when none has a key: the statement then pads them with
// NULLs, and keyless jobs send nothing more.
func concurrencyKeys(jobs []NewJob, idx []int) ([]string, []int32) {
	keys, limits := []string{}, []int32{}
	for r, i := range idx {
		if jobs[i].ConcurrencyKey == "" {
			continue
		}
		if len(keys) == 0 {
			keys, limits = make([]string, len(idx)), make([]int32, len(idx))
		}
		keys[r], limits[r] = jobs[i].ConcurrencyKey, int32(jobs[i].ConcurrencyLimit)
	}
	return keys, limits
}
