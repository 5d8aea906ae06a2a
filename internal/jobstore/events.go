package jobstore

import (
	"context"
	"log/slog"
)

// DeadEvent describes a job that has just died.
type DeadEvent struct {
	JobID, Kind, Queue, BusinessKey, Class, Error, TraceID string
	Attempts                                               int
}

// LogDied logs e at Error level as "keel: job died": the one line a death
// gets, from server.New's default OnDead or from an alerter.
func (e DeadEvent) LogDied(ctx context.Context, log *slog.Logger) {
	log.LogAttrs(ctx, slog.LevelError, "keel: job died",
		slog.String("job_id", e.JobID), slog.String("kind", e.Kind), slog.String("queue", e.Queue),
		slog.String("business_key", e.BusinessKey), slog.String("class", e.Class),
		slog.Int("attempts", e.Attempts), slog.String("err", e.Error))
}
