package testenv

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresServer is a private Postgres for tests that stop, restart or cut
// off Postgres, which they must never do to the shared one. Its data lives
// in a temporary directory and is kept across Stop and Start.
type PostgresServer struct {
	t    testing.TB
	Port int
	bin  string
	dir  string
	cred *syscall.Credential // set when running as root: postgres refuses root
	cmd  *exec.Cmd
	done chan struct{}
}

// postgresBinDir finds the directory holding initdb and postgres.
func postgresBinDir() (string, error) {
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
	return "", fmt.Errorf("no initdb found (pg_config --bindir, /usr/lib/postgresql/*/bin)")
}

// StartPostgres initialises a database cluster in a temporary directory
// and starts it on a free loopback port with trust authentication and no
// fsync, stopped and removed when the test ends. It skips the test when
// the Postgres server binaries are not installed. Run as root, the server
// runs as the postgres user.
func StartPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	bin, err := postgresBinDir()
	if err != nil {
		t.Skipf("testenv: Postgres server binaries not installed (apt-get install postgresql): %v", err)
	}
	s := &PostgresServer{t: t, bin: bin}
	// Not t.TempDir: its parent is private to root, and the server may not
	// run as root.
	s.dir, err = os.MkdirTemp("", "keel-postgres-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(s.dir) })
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skipf("testenv: running as root and there is no postgres user to run a private Postgres as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(s.dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	initdb := s.command("initdb", "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("testenv: initdb: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Port = l.Addr().(*net.TCPAddr).Port
	l.Close()
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

func (s *PostgresServer) data() string { return filepath.Join(s.dir, "data") }

func (s *PostgresServer) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.dir
	// The server must not outlive a test binary that dies without cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Pdeathsig: syscall.SIGQUIT}
	return cmd
}

// URL is a connection string for database db ("postgres" when empty).
func (s *PostgresServer) URL(db string) string {
	if db == "" {
		db = "postgres"
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.Port, db)
}

// Start (re)starts the server on its port and waits until it accepts
// connections.
func (s *PostgresServer) Start() {
	s.t.Helper()
	s.cmd = s.command("postgres", "-D", s.data(), "-p", strconv.Itoa(s.Port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
		"-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
		"-c", "max_connections=200")
	log, err := os.OpenFile(filepath.Join(s.dir, "postgres.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer log.Close()
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("testenv: start postgres: %v", err)
	}
	done := make(chan struct{})
	s.done = done
	go func(cmd *exec.Cmd) { _ = cmd.Wait(); close(done) }(s.cmd)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			s.t.Fatalf("testenv: postgres exited at start; its log:\n%s", s.Log())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, s.URL(""))
		if err == nil {
			conn.Close(ctx)
			cancel()
			return
		}
		cancel()
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Fatalf("testenv: postgres on port %d did not answer; its log:\n%s", s.Port, s.Log())
}

// Stop shuts the server down the fast way (SIGINT: open transactions are
// rolled back, sessions cut, data kept) and waits until it has exited.
func (s *PostgresServer) Stop() {
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

// Log is what the server has written to its log so far.
func (s *PostgresServer) Log() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "postgres.log"))
	return string(b)
}

// String names the server in failure messages.
func (s *PostgresServer) String() string { return fmt.Sprintf("postgres 127.0.0.1:%d", s.Port) }
