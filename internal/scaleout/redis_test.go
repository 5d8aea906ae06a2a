package scaleout_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/testenv"
)

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startRedis runs redis-server with extra arguments on a free port until the
// test ends.
func startRedis(t *testing.T, args ...string) int {
	t.Helper()
	return spawnRedis(t, args...).port
}

// redisProc is a redis-server child process the test may signal.
type redisProc struct {
	port int
	cmd  *exec.Cmd
}

func (p *redisProc) addr() string { return fmt.Sprint("127.0.0.1:", p.port) }

// spawnRedis is startRedis keeping hold of the process. The free port it
// picks may be taken before redis-server binds it (by another test's
// server, or the cluster bus port 10000 above it); redis-server then exits
// at once, and spawnRedis tries another port.
func spawnRedis(t *testing.T, args ...string) *redisProc {
	t.Helper()
	var out testenv.SyncBuffer
	for range 5 {
		port := freePort(t)
		dir := t.TempDir()
		all := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--loglevel", "warning"}, args...)
		cmd := exec.Command("redis-server", all...)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatalf("start redis-server: %v", err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
		if ours(port, cmd.Process.Pid, exited) {
			return &redisProc{port: port, cmd: cmd}
		}
	}
	t.Fatalf("redis-server never answered on a port of its own:\n%s", out.String())
	return nil
}

// ours waits until the redis-server pid answers on port, and reports
// false when it exits first (it could not bind) or another answers there.
func ours(port, pid int, exited <-chan struct{}) bool {
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprint("127.0.0.1:", port)})
	defer c.Close()
	for range 400 {
		select {
		case <-exited:
			return false
		default:
		}
		if info, err := c.Info(context.Background(), "server").Result(); err == nil {
			return strings.Contains(info, fmt.Sprintf("process_id:%d\r\n", pid))
		}
		time.Sleep(25 * time.Millisecond)
	}
	return false
}

func waitPing(t *testing.T, port int) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprint("127.0.0.1:", port)})
	defer c.Close()
	for range 200 {
		if c.Ping(context.Background()).Err() == nil {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("redis on port %d never answered", port)
}

// startCluster starts a three-master Redis Cluster on loopback and returns
// its nodes' addresses.
func startCluster(t *testing.T) []string {
	t.Helper()
	var addrs []string
	for range 3 {
		port := startRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		addrs = append(addrs, fmt.Sprint("127.0.0.1:", port))
	}
	out, err := exec.Command("redis-cli", append(append([]string{"--cluster", "create"}, addrs...),
		"--cluster-replicas", "0", "--cluster-yes")...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	defer c.Close()
	for range 200 {
		info, err := c.ClusterInfo(context.Background()).Result()
		if err == nil && strings.Contains(info, "cluster_state:ok") {
			return addrs
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("cluster never reached cluster_state:ok")
	return nil
}

// startSentinel starts a master and one sentinel watching it as "keel".
func startSentinel(t *testing.T) (sentinel string) {
	t.Helper()
	master := startRedis(t)
	port := freePort(t)
	conf := filepath.Join(t.TempDir(), "sentinel.conf")
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\nsentinel monitor keel 127.0.0.1 %d 1\nsentinel down-after-milliseconds keel 2000\n", port, master)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("redis-server", conf, "--sentinel")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sentinel: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitPing(t, port)
	return fmt.Sprint("127.0.0.1:", port)
}

// needRedisTools skips a test that starts its own Redis processes on a
// machine without them.
func needRedisTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed: this test starts its own Redis processes", tool)
		}
	}
}
