package web

import (
	"context"
	"net/http"
	"strings"

	"github.com/keeljobs/keel/inspect"
)

// keysShown bounds the concurrency keys the keys page lists.
const keysShown = 200

type keysData struct {
	Kind, Key string
	Rows      []inspect.KeyCount
	Held      []inspect.HeldCount
}

// concurrencyKeys shows a kind's concurrency keys (tasks.ConcurrencyKey):
// each key's jobs in flight and held, most held first. Without a kind it
// lists the kinds with held jobs.
func (s *Server) concurrencyKeys(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	d := keysData{Kind: strings.TrimSpace(q.Get("kind")), Key: q.Get("key")}
	var err error
	if d.Kind == "" {
		d.Held, err = s.ops.HeldByKind(ctx)
	} else {
		d.Rows, err = s.ops.ConcurrencyKeys(ctx, d.Kind, d.Key, keysShown)
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	s.render(w, r, http.StatusOK, "keys", view{Title: "Concurrency keys", Nav: "keys", Data: d})
}
