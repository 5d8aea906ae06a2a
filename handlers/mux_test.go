package handlers_test

import (
	"net/http"
	"time"

	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/keeltest"
	"github.com/keeljobs/keel/tasks"
)

func tasksMux(h *keeltest.Harness, mailURL string) *tasks.Mux {
	m := tasks.NewMux()
	handlers.Register(m, handlers.Deps{Pool: h.Pool, Mailer: handlers.HTTPMailer{BaseURL: mailURL,
		Client: &http.Client{Timeout: 2 * time.Second}}})
	return m
}
