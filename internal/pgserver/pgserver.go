// Package pgserver runs a private Postgres: a database cluster initialised
// in a temporary directory and served on a free loopback port. Tests that
// stop or cut off Postgres use it (through testenv), and so does the
// ledger-at-scale benchmark, which needs settings of its own (autovacuum)
// and must not load millions of rows into a shared server.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrUnavailable is wrapped by Init's error when a private Postgres cannot
// run here at all: no server binaries, or running as root without a
// postgres user to run it as.
var ErrUnavailable = errors.New("pgserver: a private Postgres cannot run here")

// Server is a private Postgres. Its data lives in a temporary directory and
// is kept across Stop and Start; Remove deletes it.
type Server struct {
	Port     int
	bin      string
	dir      string
	settings []string
	cred     *syscall.Credential // set when running as root: postgres refuses root
	cmd      *exec.Cmd
	done     chan struct{}
}

// Available returns nil when Init can run here, and otherwise an error
// that wraps ErrUnavailable.
func Available() error {
	if _, err := binDir(); err != nil {
		return fmt.Errorf("%w: %v (apt-get install postgresql)", ErrUnavailable, err)
	}
	if os.Geteuid() == 0 {
		if _, err := user.Lookup("postgres"); err != nil {
			return fmt.Errorf("%w: running as root and there is no postgres user to run it as: %v", ErrUnavailable, err)
		}
	}
	return nil
}

// Init initialises a database cluster (trust authentication, user
// postgres) in a new temporary directory and picks a free loopback port; it
// does not start the server. settings are "name=value" pairs given to
// every Start with -c. Run as root, the server runs as the postgres user.
func Init(settings ...string) (*Server, error) {
	bin, err := binDir()
	if err != nil {
		return nil, fmt.Errorf("%w: %v (apt-get install postgresql)", ErrUnavailable, err)
	}
	s := &Server{bin: bin, settings: settings}
	var uid, gid int
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("%w: running as root and there is no postgres user to run it as: %v", ErrUnavailable, err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	// Not a test's TempDir: its parent is private to root, and the server
	// may not run as root.
	if s.dir, err = os.MkdirTemp("", "keel-postgres-"); err != nil {
		return nil, err
	}
	if s.cred != nil {
		if err := os.Chown(s.dir, uid, gid); err != nil {
			s.Remove()
			return nil, err
		}
	}
	initdb := s.command("initdb", "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	if out, err := initdb.CombinedOutput(); err != nil {
		s.Remove()
		return nil, fmt.Errorf("pgserver: initdb: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.Remove()
		return nil, err
	}
	s.Port = l.Addr().(*net.TCPAddr).Port
	l.Close()
	return s, nil
}

// binDir finds the directory holding initdb and postgres.
func binDir() (string, error) {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir := strings.TrimSpace(string(out))
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "initdb")); err == nil {
			return dirs[i], nil
		}
	}
	return "", errors.New("no initdb found (pg_config --bindir, /usr/lib/postgresql/*/bin)")
}

func (s *Server) data() string { return filepath.Join(s.dir, "data") }

func (s *Server) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.dir
	// The server must not outlive a program that dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Pdeathsig: syscall.SIGQUIT}
	return cmd
}

// URL is a connection string for database db ("postgres" when empty).
func (s *Server) URL(db string) string {
	if db == "" {
		db = "postgres"
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.Port, db)
}

// Start (re)starts the server on its port and waits until it accepts
// connections.
func (s *Server) Start() error {
	args := []string{"-D", s.data(), "-p", strconv.Itoa(s.Port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="}
	for _, kv := range s.settings {
		args = append(args, "-c", kv)
	}
	cmd := s.command("postgres", args...)
	log, err := os.OpenFile(filepath.Join(s.dir, "postgres.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgserver: start postgres: %w", err)
	}
	done := make(chan struct{})
	s.cmd, s.done = cmd, done
	go func() { _ = cmd.Wait(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			s.cmd = nil
			return fmt.Errorf("pgserver: postgres exited at start; its log:\n%s", s.Log())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, s.URL(""))
		if err == nil {
			conn.Close(ctx)
			cancel()
			return nil
		}
		cancel()
		time.Sleep(20 * time.Millisecond)
	}
	s.Stop()
	return fmt.Errorf("pgserver: postgres on port %d did not answer; its log:\n%s", s.Port, s.Log())
}

// Stop shuts the server down the fast way (SIGINT: open transactions are
// rolled back, sessions cut, data kept) and waits until it has exited.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd = nil
}

// Remove stops the server and deletes its data.
func (s *Server) Remove() {
	s.Stop()
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}

// Log is what the server has written to its log so far.
func (s *Server) Log() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "postgres.log"))
	return string(b)
}

// String names the server in messages.
func (s *Server) String() string { return fmt.Sprintf("postgres 127.0.0.1:%d", s.Port) }
