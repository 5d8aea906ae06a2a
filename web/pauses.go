package web

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strings"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// pausesData is the Pauses page: the queues and kinds the ledger holds
// paused, and for operators the forms that pause and resume them.
type pausesData struct {
	Queues []inspect.QueuePause
	Kinds  []inspect.KindPause
	// What, Name, Note refill the form a refused action came from.
	What, Name, Note string
}

// pauseFlashes are the messages a pause action's redirect may ask for.
var pauseFlashes = map[string]string{
	"paused-queue":          "Paused: no worker starts the queue's jobs; running ones finish.",
	"paused-queue-already":  "The queue was paused already.",
	"resumed-queue":         "Resumed: workers take the queue's jobs again, and those it held go back to the relay, once.",
	"resumed-queue-already": "The queue was not paused.",
	"paused-kind":           "Paused: the kind's waiting jobs are held in the ledger; running ones finish.",
	"paused-kind-already":   "The kind was paused already.",
	"resumed-kind":          "Resumed: the jobs the kind held go back to the relay, once.",
	"resumed-kind-already":  "The kind was not paused.",
}

// pausedBy says which of a held job's pauses still stand.
type pausedBy struct{ kind, queue bool }

// pausesHolding reads which pauses hold job j (status paused): its kind's,
// or its queue's when Redis delivered the job without the pause.
func (s *Server) pausesHolding(ctx context.Context, j idempotency.Job) (pausedBy, error) {
	var held pausedBy
	var err error
	held.kind, held.queue, err = s.ops.PausesHolding(ctx, j.Kind, j.Queue)
	return held, err
}

func (s *Server) pauses(w http.ResponseWriter, r *http.Request) {
	s.pausesPage(w, r, http.StatusOK, pauseFlashes[r.URL.Query().Get("done")], "", pausesData{})
}

func (s *Server) pausesPage(w http.ResponseWriter, r *http.Request, status int, flash, errMsg string, d pausesData) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	var err error
	if d.Queues, err = s.ops.PausedQueues(ctx); err != nil {
		s.ledgerError(w, r, err)
		return
	}
	if d.Kinds, err = s.ops.PausedKinds(ctx); err != nil {
		s.ledgerError(w, r, err)
		return
	}
	s.render(w, r, status, "pauses", view{Title: "Pauses", Nav: "pauses", Flash: flash, Error: errMsg, Data: d})
}

// pauseAction pauses or resumes a queue or a kind (form fields what,
// name, action, note), audited under the signed-in operator.
func (s *Server) pauseAction(w http.ResponseWriter, r *http.Request) {
	p := principalFrom(r.Context())
	what, name, action := r.PostForm.Get("what"), strings.TrimSpace(r.PostForm.Get("name")), r.PostForm.Get("action")
	note := strings.TrimSpace(r.PostForm.Get("note"))
	var changed bool
	var err error
	switch {
	case what == "queue" && action == "pause":
		changed, err = s.ops.PauseQueue(r.Context(), name, p.Name, note)
	case what == "queue" && action == "resume":
		changed, err = s.ops.ResumeQueue(r.Context(), name, p.Name, note)
	case what == "kind" && action == "pause":
		changed, err = s.ops.PauseKind(r.Context(), name, p.Name, note)
	case what == "kind" && action == "resume":
		changed, err = s.ops.ResumeKind(r.Context(), name, p.Name, note)
	default:
		http.Error(w, "what must be queue or kind, action pause or resume", http.StatusBadRequest)
		return
	}
	if err != nil {
		status := http.StatusBadRequest
		if !errors.Is(err, inspect.ErrInvalidName) {
			status = http.StatusInternalServerError
			s.cfg.Logger.Error("keel web: pause action failed", "what", what, "name", name, "action", action, "err", err)
		}
		s.pausesPage(w, r, status, "", action+" refused: "+err.Error(), pausesData{What: what, Name: name, Note: note})
		return
	}
	s.cfg.Logger.Info("keel web: "+what+" "+action+"d", what, name, "actor", p.Name, "changed", changed)
	done := action + "d-" + what
	if !changed {
		done += "-already"
	}
	http.Redirect(w, r, "/pauses?done="+url.QueryEscape(done), http.StatusSeeOther)
}
