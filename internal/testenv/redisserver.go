package testenv

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServer is a private redis-server for tests that stop, restart or
// flush Redis, which they must never do to the shared one.
type RedisServer struct {
	t    testing.TB
	Port int
	cmd  *exec.Cmd
}

// StartRedis starts a redis-server on a free loopback port, without
// persistence, stopped when the test ends.
func StartRedis(t testing.TB) *RedisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("testenv: redis-server not installed (scripts/services installs it): %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &RedisServer{t: t, Port: port}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// Addr is host:port of the server.
func (s *RedisServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.Port) }

// Start (re)starts the server, empty, and waits until it answers.
func (s *RedisServer) Start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("testenv: start redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c.Ping(context.Background()).Err() == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.t.Fatalf("testenv: redis-server on %s did not answer", s.Addr())
}

// Stop kills the server (its data is gone: it keeps nothing on disk).
func (s *RedisServer) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// String names the server in failure messages.
func (s *RedisServer) String() string { return fmt.Sprintf("redis-server %s", s.Addr()) }
