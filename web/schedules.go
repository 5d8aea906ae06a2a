package web

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/keeljobs/keel/inspect"
)

type schedulesData struct {
	Rows []scheduleRow
}

type scheduleRow struct {
	inspect.Schedule
	// Idle: no scheduler has said lately that it runs the entry.
	Idle bool
}

// scheduleFlashes are the messages a redirect after a pause or resume can
// ask the page to show.
var scheduleFlashes = map[string]string{
	"paused":          "Paused: no scheduler enqueues the entry's ticks (within a couple of seconds); they are not caught up on resume.",
	"already-paused":  "Nothing to do: the entry was already paused; who paused it is below.",
	"resumed":         "Resumed: schedulers enqueue the entry again from its next tick.",
	"already-resumed": "Nothing to do: the entry was not paused.",
}

func (s *Server) schedules(w http.ResponseWriter, r *http.Request) {
	s.schedulesPage(w, r, http.StatusOK, scheduleFlashes[r.URL.Query().Get("done")], "")
}

func (s *Server) schedulesPage(w http.ResponseWriter, r *http.Request, status int, flash, errMsg string) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	all, err := s.ops.Schedules(ctx)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	var d schedulesData
	for _, sc := range all {
		d.Rows = append(d.Rows, scheduleRow{Schedule: sc, Idle: !sc.Running(time.Now())})
	}
	s.render(w, r, status, "schedules", view{Title: "Schedules", Nav: "schedules", Flash: flash, Error: errMsg, Data: d})
}

// scheduleAction pauses or resumes the entry the form names (a name may
// hold a slash, so it is a field, not part of the path).
func (s *Server) scheduleAction(resume bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name, p := r.PostForm.Get("entry"), principalFrom(r.Context())
		note := strings.TrimSpace(r.PostForm.Get("note"))
		verb := "pause"
		var changed bool
		var err error
		if resume {
			verb = "resume"
			changed, err = s.ops.ResumeSchedule(r.Context(), name, p.Name, note)
		} else {
			changed, err = s.ops.PauseSchedule(r.Context(), name, p.Name, note)
		}
		if err != nil {
			status := http.StatusNotFound
			if !errors.Is(err, inspect.ErrNotFound) {
				status = http.StatusInternalServerError
				s.cfg.Logger.Error("keel web: schedule action failed", "action", verb, "entry", name, "err", err)
			}
			s.schedulesPage(w, r, status, "", verb+" refused: "+err.Error())
			return
		}
		done := verb + "d"
		if !changed {
			done = "already-" + done
		}
		s.cfg.Logger.Info("keel web: schedule entry "+done, "entry", name, "actor", p.Name)
		http.Redirect(w, r, "/schedules?done="+url.QueryEscape(done), http.StatusSeeOther)
	}
}
