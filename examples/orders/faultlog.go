package main

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
)

// demoLogger logs at Info the failures the demo's mail service at mailURL
// provokes on purpose (its 503s, 429s, bounces, slow and lost replies):
// they are the demo, and at its warn level they would bury the status line.
// Any other failure keeps its level.
func demoLogger(log *slog.Logger, mailURL string) *slog.Logger {
	send := mailURL + "/send"
	return slog.New(simulatedFaults{Handler: log.Handler(), faults: []string{
		"POST " + send + ": 503 Service Unavailable: upstream unavailable",
		"POST " + send + ": 429 Too Many Requests: slow down",
		"POST " + send + ": 422 Unprocessable Entity: mailbox does not exist",
		// How Go's HTTP client words a cut connection and a held reply.
		"Post " + strconv.Quote(send) + ": EOF",
		"Post " + strconv.Quote(send) + ": context deadline exceeded (Client.Timeout exceeded",
	}})
}

// simulatedFaults lowers to Info a Warn or Error record whose err names one
// of faults.
type simulatedFaults struct {
	slog.Handler
	faults []string
}

func (s simulatedFaults) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn && s.simulated(r) {
		if !s.Handler.Enabled(ctx, slog.LevelInfo) {
			return nil
		}
		r.Level = slog.LevelInfo
	}
	return s.Handler.Handle(ctx, r)
}

func (s simulatedFaults) simulated(r slog.Record) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key != "err" {
			return true
		}
		for _, f := range s.faults {
			found = found || strings.Contains(a.Value.String(), f)
		}
		return false
	})
	return found
}

func (s simulatedFaults) WithAttrs(as []slog.Attr) slog.Handler {
	return simulatedFaults{Handler: s.Handler.WithAttrs(as), faults: s.faults}
}

func (s simulatedFaults) WithGroup(name string) slog.Handler {
	return simulatedFaults{Handler: s.Handler.WithGroup(name), faults: s.faults}
}
