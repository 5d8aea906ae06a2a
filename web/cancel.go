package web

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"

	"github.com/keeljobs/keel/idempotency"
)

// cancelJob is the job page's Cancel button.
func (s *Server) cancelJob(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	note := strings.TrimSpace(r.PostForm.Get("note"))
	res, err := s.ops.Cancel(r.Context(), id, p.Name, note)
	if err != nil {
		s.actionFailed(w, r, id, "cancel", err, note)
		return
	}
	done := "cancelled"
	switch {
	case res.AlreadyCancelled:
		done = "already-cancelled"
	case res.WasRunning:
		done = "cancelled-running"
	}
	s.cfg.Logger.Info("keel web: job cancelled", "job_id", id, "actor", p.Name, "already", res.AlreadyCancelled,
		"was_running", res.WasRunning, "redis_err", res.RedisErr)
	http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done="+done, http.StatusSeeOther)
}

// cancellable reports whether a job in status may still be cancelled.
func cancellable(st idempotency.Status) bool {
	return st == idempotency.StatusWaiting || st == idempotency.StatusPending || st == idempotency.StatusPaused ||
		st == idempotency.StatusRunning || st == idempotency.StatusFailed
}

// Cancellable says whether the job page offers Cancel.
func (d jobData) Cancellable() bool { return cancellable(d.Job.Status) }

// monitorCancel matches asynqmon's API calls that stop or remove a task:
// cancelling an active one, deleting a pending, scheduled or retrying one.
var monitorCancel = regexp.MustCompile(`^(?:POST /queues/([^/]+)/active_tasks(/[^/]+:cancel|:batch_cancel|:cancel_all)` +
	`|DELETE /queues/([^/]+)/(?:pending|scheduled|retry)_tasks(/[^/:]+|:delete_all)` +
	`|POST /queues/([^/]+)/(?:pending|scheduled|retry)_tasks(:batch_delete))$`)

// cancelThroughKeel takes over asynqmon's cancel of an active task and
// delete of a waiting one. For a keel job either one means "do not run
// this": in asynq alone a cancelled run counts as a failure and is retried,
// and a deleted task is published again by the reconciler, because the
// ledger still says the job should run. keel cancels the job instead
// (through the ledger, with the audit entry). Tasks keel does not know are
// left to asynqmon, and so are those of jobs that have ended. It reports
// whether it answered.
func (s *Server) cancelThroughKeel(w http.ResponseWriter, r *http.Request, p *principal) bool {
	rest, ok := strings.CutPrefix(r.URL.Path, MonitoringPath+"/api")
	if !ok {
		return false
	}
	m := monitorCancel.FindStringSubmatch(r.Method + " " + rest)
	if m == nil {
		return false
	}
	action := m[2] + m[4] + m[6]
	switch {
	case action == ":cancel_all" || action == ":delete_all":
		http.Error(w, "keel: these tasks are keel jobs; cancel them from keel's jobs page (/jobs), "+
			"which records the cancel in the ledger (otherwise a cancelled run is retried and a deleted task published again)",
			http.StatusConflict)
		return true
	case action == ":batch_cancel" || action == ":batch_delete":
		var req struct {
			TaskIDs []string `json:"task_ids"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, maxFormBytes)).Decode(&req); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return true
		}
		queue := m[1] + m[3] + m[5]
		var ok, failed []string
		for _, id := range req.TaskIDs {
			known, err := s.cancelFromMonitor(r.Context(), id, p)
			if !known {
				if action == ":batch_cancel" {
					err = s.insp.CancelProcessing(id)
				} else {
					err = s.insp.DeleteTask(queue, id)
				}
			}
			if err != nil {
				failed = append(failed, id)
				continue
			}
			ok = append(ok, id)
		}
		resp := map[string][]string{"error_ids": nonNilIDs(failed)}
		if action == ":batch_cancel" {
			resp["canceled_ids"] = nonNilIDs(ok)
		} else {
			resp["deleted_ids"] = nonNilIDs(ok)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(resp)
		return true
	default: // one task: "/ID:cancel" or "/ID"
		id := strings.TrimSuffix(strings.TrimPrefix(action, "/"), ":cancel")
		known, err := s.cancelFromMonitor(r.Context(), id, p)
		return answerMonitorAction(w, id, known, err)
	}
}

// cancelFromMonitor cancels the keel job id, if there is one that has not
// finished. A stray task of a job that has ended is asynqmon's to remove:
// nothing publishes it again, and a delivery would only be acknowledged.
func (s *Server) cancelFromMonitor(ctx context.Context, id string, p *principal) (known bool, err error) {
	if j, err := s.store.Get(ctx, id); errors.Is(err, idempotency.ErrNotFound) || (err == nil && !cancellable(j.Status)) {
		return false, nil
	} else if err != nil {
		return true, err
	}
	res, err := s.ops.Cancel(ctx, id, p.Name, "cancelled from asynqmon")
	if err == nil {
		s.cfg.Logger.Info("keel web: job cancelled from asynqmon", "job_id", id, "actor", p.Name, "already", res.AlreadyCancelled)
	}
	return true, err
}

func nonNilIDs(ids []string) []string {
	if ids == nil {
		return []string{}
	}
	return ids
}

// monitorArchive matches asynqmon's API calls that archive waiting tasks.
var monitorArchive = regexp.MustCompile(`^POST /queues/([^/]+)/(?:pending|scheduled|retry)_tasks(/[^/:]+:archive|:batch_archive|:archive_all)$`)

// archiveThroughKeel refuses asynqmon's archive of a waiting task of a keel
// job not finished: the ledger still says the job should run, so the
// reconciler would remove the archived copy and publish it again — an
// archive that answers 204 and is undone seconds later. keel has no
// "park": the job's page cancels it. Tasks keel does not know, and stray
// tasks of jobs that ended, are left to asynqmon. It reports whether it
// answered.
func (s *Server) archiveThroughKeel(w http.ResponseWriter, r *http.Request) bool {
	rest, ok := strings.CutPrefix(r.URL.Path, MonitoringPath+"/api")
	if !ok {
		return false
	}
	m := monitorArchive.FindStringSubmatch(r.Method + " " + rest)
	if m == nil {
		return false
	}
	const why = "the ledger says it should run, and keel's reconciler would publish an archived copy again; cancel it on its page in keel"
	switch action := m[2]; action {
	case ":archive_all":
		http.Error(w, "keel: these tasks are keel jobs: "+why+" (/jobs)", http.StatusConflict)
		return true
	case ":batch_archive":
		var req struct {
			TaskIDs []string `json:"task_ids"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, maxFormBytes)).Decode(&req); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return true
		}
		archived, failed := []string{}, []string{}
		for _, id := range req.TaskIDs {
			open, err := s.openJob(r.Context(), id)
			if err == nil && !open {
				err = s.insp.ArchiveTask(m[1], id)
			}
			if err != nil || open {
				failed = append(failed, id)
				continue
			}
			archived = append(archived, id)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string][]string{"archived_ids": archived, "error_ids": failed})
		return true
	default: // "/ID:archive"
		id := strings.TrimSuffix(strings.TrimPrefix(action, "/"), ":archive")
		open, err := s.openJob(r.Context(), id)
		switch {
		case err != nil:
			http.Error(w, "keel: "+err.Error(), http.StatusServiceUnavailable)
		case open:
			http.Error(w, "keel: task "+id+" is a keel job: "+why+": /jobs/"+url.PathEscape(id), http.StatusConflict)
		default:
			return false
		}
		return true
	}
}

// openJob reports whether id is a keel job that has not finished.
func (s *Server) openJob(ctx context.Context, id string) (bool, error) {
	j, err := s.store.Get(ctx, id)
	if errors.Is(err, idempotency.ErrNotFound) {
		return false, nil
	}
	return err == nil && cancellable(j.Status), err
}
