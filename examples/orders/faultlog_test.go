package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The failures the simulated mail service provokes on purpose log at Info,
// so the demo's warn level keeps its status line readable; any other
// failure keeps its level.
func TestDemoLogsSimulatedFaultsAtInfo(t *testing.T) {
	const mail = "http://127.0.0.1:8025"
	logAt := func(level slog.Level) (*slog.Logger, *bytes.Buffer) {
		var buf bytes.Buffer
		return demoLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: level})), mail), &buf
	}
	simulated := []string{
		`keel: step "mail" of job j is in doubt; Verify settles it when the job runs again: a server error, which may come after the effect: POST ` + mail + `/send: 503 Service Unavailable: upstream unavailable`,
		`keel: step "mail" of job j is in doubt; Verify settles it when the job runs again: sent, no answer: Post "` + mail + `/send": EOF`,
		`keel: step "mail" of job j is in doubt: sent, no answer: Post "` + mail + `/send": context deadline exceeded (Client.Timeout exceeded while awaiting headers)`,
		`POST ` + mail + `/send: 422 Unprocessable Entity: mailbox does not exist`,
		`POST ` + mail + `/send: 429 Too Many Requests: slow down`,
	}
	for _, err := range simulated {
		log, buf := logAt(slog.LevelInfo)
		log.With("kind", "order:send_receipt").Warn("keel: job failed", "err", err)
		log.Error("keel: job died", "class", "permanent", "err", err)
		require.Equal(t, 2, strings.Count(buf.String(), "level=INFO"), buf.String())
		require.NotContains(t, buf.String(), "level=WARN")
		require.NotContains(t, buf.String(), "level=ERROR")
		require.Contains(t, buf.String(), "kind=order:send_receipt")

		log, buf = logAt(slog.LevelWarn)
		log.Warn("keel: job failed", "err", err)
		require.Empty(t, buf.String(), "at the demo's warn level")
	}
	for _, err := range []string{
		`keel: verifying step "mail": Get "` + mail + `/sent?key=k": dial tcp 127.0.0.1:8025: connect: connection refused`,
		`POST http://elsewhere/send: 503 Service Unavailable: upstream unavailable`,
		`keel: ledger unavailable: ERROR: relation "orders" does not exist`,
	} {
		log, buf := logAt(slog.LevelWarn)
		log.Warn("keel: job failed", "err", err)
		log.Error("keel: job died", "err", err)
		require.Contains(t, buf.String(), "level=WARN", err)
		require.Contains(t, buf.String(), "level=ERROR", err)
	}
}
