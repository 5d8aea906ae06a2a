package testenv

import (
	"errors"
	"testing"

	"github.com/keeljobs/keel/internal/pgserver"
)

// PostgresServer is a private Postgres for tests that stop, restart or cut
// off Postgres, which they must never do to the shared one. Its data lives
// in a temporary directory and is kept across Stop and Start.
type PostgresServer struct {
	*pgserver.Server
	t testing.TB
}

// StartPostgres initialises a database cluster in a temporary directory
// and starts it on a free loopback port with trust authentication and no
// fsync, stopped and removed when the test ends. It skips the test when
// the Postgres server binaries are not installed. Run as root, the server
// runs as the postgres user. settings ("name=value") are added to those;
// a later one of the same name wins.
func StartPostgres(t testing.TB, settings ...string) *PostgresServer {
	t.Helper()
	s, err := pgserver.Init(append([]string{"fsync=off", "synchronous_commit=off", "full_page_writes=off", "max_connections=200"},
		settings...)...)
	if errors.Is(err, pgserver.ErrUnavailable) {
		t.Skipf("testenv: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Remove)
	pg := &PostgresServer{Server: s, t: t}
	pg.Start()
	return pg
}

// Start (re)starts the server on its port and waits until it accepts
// connections; it fails the test when it does not.
func (s *PostgresServer) Start() {
	s.t.Helper()
	if err := s.Server.Start(); err != nil {
		s.t.Fatalf("testenv: %v", err)
	}
}
