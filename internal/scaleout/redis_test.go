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

// spawnRedis is startRedis keeping hold of the process.
func spawnRedis(t *testing.T, args ...string) *redisProc {
	t.Helper()
	port := freePort(t)
	dir := t.TempDir()
	all := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--loglevel", "warning"}, args...)
	cmd := exec.Command("redis-server", all...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitPing(t, port)
	return &redisProc{port: port, cmd: cmd}
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
