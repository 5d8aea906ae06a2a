package web

import (
	"net/http"
	"regexp"
	"strings"
)

// monitorPause matches asynqmon's pause and resume of a queue.
var monitorPause = regexp.MustCompile(`^POST /queues/([^/]+):(pause|resume)$`)

// pauseThroughKeel takes over asynqmon's pause and resume buttons: asynq
// keeps a pause in Redis only, which a Redis that loses its data forgets,
// so keel records it in the ledger (audited), and reconcilers put it back.
// keel's `queue pause` and asynqmon's button then agree. It reports
// whether it answered.
func (s *Server) pauseThroughKeel(w http.ResponseWriter, r *http.Request, p *principal) bool {
	rest, ok := strings.CutPrefix(r.URL.Path, MonitoringPath+"/api")
	if !ok {
		return false
	}
	m := monitorPause.FindStringSubmatch(r.Method + " " + rest)
	if m == nil {
		return false
	}
	queue, resume := m[1], m[2] == "resume"
	var err error
	if resume {
		_, err = s.ops.ResumeQueue(r.Context(), queue, p.Name, "resumed from asynqmon")
	} else {
		_, err = s.ops.PauseQueue(r.Context(), queue, p.Name, "paused from asynqmon")
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return true
	}
	s.cfg.Logger.Info("keel web: queue paused or resumed from asynqmon", "queue", queue, "resume", resume, "actor", p.Name)
	w.WriteHeader(http.StatusNoContent)
	return true
}
