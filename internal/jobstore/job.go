package jobstore

import (
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// newJob is the Job of a row just written from nj: the values Postgres
// chose are row's, the rest is nj as given, so an insert does not send
// back every column of every row.
func newJob(r ledger.NewRow, nj NewJob) Job {
	// A copy, as a row read back would be: the caller may reuse its buffer.
	payload := append([]byte{}, nj.Payload...)
	j := Job{ID: r.ID, Kind: nj.Kind, BusinessKey: nj.BusinessKey, Queue: nj.Queue, Payload: payload,
		Status: r.Status, MaxRetry: nj.MaxRetry, Timeout: time.Duration(nj.Timeout.Milliseconds()) * time.Millisecond,
		Deadline: r.Deadline, RunAt: r.RunAt, PublishedAt: r.PublishedAt, TraceID: nj.TraceID,
		PayloadSummary: nj.PayloadSummary, CreatedAt: r.CreatedAt, UpdatedAt: r.CreatedAt,
		TraceParent: nj.TraceParent, TraceState: nj.TraceState, BatchID: nj.BatchID, ConcurrencyKey: nj.ConcurrencyKey}
	if j.Status == ledger.StatusWaiting && nj.ConcurrencyKey != "" && j.WaitingOn == 0 {
		j.KeyHeldSince = &r.CreatedAt
	}
	return j
}
