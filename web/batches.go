package web

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
)

// openMembersShown bounds the open members a batch page lists.
const openMembersShown = 100

type batchRow struct {
	jobstore.Batch
	State string
}

type batchesData struct {
	Rows     []batchRow
	OpenOnly bool
}

func (s *Server) batches(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	d := batchesData{OpenOnly: r.URL.Query().Get("open") == "1"}
	bs, err := s.store.ListBatches(ctx, jobstore.BatchFilter{Open: d.OpenOnly, Limit: 200})
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	for _, b := range bs {
		d.Rows = append(d.Rows, batchRow{Batch: b, State: b.State()})
	}
	s.render(w, r, http.StatusOK, "batches", view{Title: "Batches", Nav: "batches", Data: d})
}

type batchCallbackView struct {
	Event, Kind, Queue string
	Job                *idempotency.Job
	Pruned             bool
}

type batchData struct {
	Batch                    jobstore.Batch
	State                    string
	Pending, Running, Failed int
	// Paused: members held because their kind is paused; Waiting: for
	// their parents, or held by their concurrency key.
	Paused, Waiting int
	Open            []idempotency.Job
	Callbacks       []batchCallbackView
}

// OpenTotal counts the members that have not ended.
func (d batchData) OpenTotal() int { return d.Pending + d.Paused + d.Waiting + d.Running + d.Failed }

// MoreOpen counts the open members the page does not list.
func (d batchData) MoreOpen() int { return d.OpenTotal() - len(d.Open) }

// Percent is how much of the batch has ended, as a whole percentage.
func (d batchData) Percent() string {
	if d.Batch.Total == 0 {
		return "100"
	}
	return strconv.Itoa(d.Batch.Ended() * 100 / d.Batch.Total)
}

func (s *Server) batch(w http.ResponseWriter, r *http.Request) {
	if canonicalRedirect(w, r, "/batches/") {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	id := r.PathValue("id")
	b, err := s.store.GetBatch(ctx, id)
	if errors.Is(err, jobstore.ErrBatchNotFound) {
		s.errorPage(w, r, http.StatusNotFound, fmt.Sprintf("no batch with id %q", id))
		return
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	d := batchData{Batch: b, State: b.State()}
	statuses, err := s.store.BatchStatuses(ctx, id)
	if err == nil {
		d.Pending, d.Running, d.Failed = statuses[idempotency.StatusPending], statuses[idempotency.StatusRunning], statuses[idempotency.StatusFailed]
		d.Paused = statuses[idempotency.StatusPaused]
		d.Waiting = statuses[idempotency.StatusWaiting]
		d.Open, err = s.store.OpenMembers(ctx, id, openMembersShown)
	}
	for _, cb := range []struct {
		event string
		spec  *jobstore.BatchCallback
		jobID string
	}{{"complete", b.OnComplete, b.CompleteJobID}, {"success", b.OnSuccess, b.SuccessJobID}} {
		if err != nil || cb.spec == nil {
			continue
		}
		v := batchCallbackView{Event: cb.event, Kind: cb.spec.Kind, Queue: cb.spec.Queue}
		if cb.jobID != "" {
			j, gerr := s.store.Get(ctx, cb.jobID)
			switch {
			case gerr == nil:
				v.Job = &j
			case errors.Is(gerr, idempotency.ErrNotFound):
				v.Pruned = true
			default:
				err = gerr
			}
		}
		d.Callbacks = append(d.Callbacks, v)
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	title := "Batch " + b.ID
	if b.Description != "" {
		title = "Batch " + b.Description
	}
	s.render(w, r, http.StatusOK, "batch", view{Title: title, Nav: "batches", Data: d})
}
