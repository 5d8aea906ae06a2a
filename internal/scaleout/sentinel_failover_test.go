package scaleout_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// sentinelGroup is a master, its replicas and the sentinels watching it as
// "keel".
type sentinelGroup struct {
	master    *redisProc
	replicas  []*redisProc
	sentinels []string
}

// startSentinelGroup starts a master, two replicas and three sentinels
// (quorum 2) that call the master down after a second without an answer.
func startSentinelGroup(t *testing.T) *sentinelGroup {
	t.Helper()
	g := &sentinelGroup{master: spawnRedis(t)}
	for range 2 {
		g.replicas = append(g.replicas, spawnRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(g.master.port)))
	}
	for range 3 {
		port := freePort(t)
		dir := t.TempDir()
		conf := filepath.Join(dir, "sentinel.conf")
		body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\n"+
			"sentinel monitor keel 127.0.0.1 %d 2\n"+
			"sentinel down-after-milliseconds keel 1000\n"+
			"sentinel failover-timeout keel 5000\n"+
			"sentinel parallel-syncs keel 2\n", port, dir, g.master.port)
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("redis-server", conf, "--sentinel", "--loglevel", "warning")
		if err := cmd.Start(); err != nil {
			t.Fatalf("start sentinel: %v", err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		waitPing(t, port)
		g.sentinels = append(g.sentinels, fmt.Sprint("127.0.0.1:", port))
	}
	// Every sentinel must know both replicas (from the master's INFO) and the
	// other sentinels (from their hellos, every 2s) before a failover can
	// reach its quorum and find a replica.
	deadline := time.Now().Add(30 * time.Second)
	for _, addr := range g.sentinels {
		s := redis.NewSentinelClient(&redis.Options{Addr: addr})
		for {
			ctx := context.Background()
			replicas, err1 := s.Replicas(ctx, "keel").Result()
			sentinels, err2 := s.Sentinels(ctx, "keel").Result()
			if err1 == nil && err2 == nil && len(replicas) == 2 && len(sentinels) == 2 && linksUp(replicas) {
				break
			}
			if time.Now().After(deadline) {
				s.Close()
				t.Fatalf("sentinel %s never saw the whole group: replicas %v (%v), sentinels %d (%v)", addr, replicas, err1, len(sentinels), err2)
			}
			time.Sleep(100 * time.Millisecond)
		}
		s.Close()
	}
	return g
}

func linksUp(replicas []map[string]string) bool {
	for _, r := range replicas {
		if r["master-link-status"] != "ok" || strings.Contains(r["flags"], "down") || strings.Contains(r["flags"], "disconnected") {
			return false
		}
	}
	return true
}

func (g *sentinelGroup) url() string {
	return "redis-sentinel://" + strings.Join(g.sentinels, ",") + "?master=keel"
}

// promoted reports whether a majority of the sentinels name a replica as
// the master.
func (g *sentinelGroup) promoted(ctx context.Context) bool {
	votes := 0
	for _, addr := range g.sentinels {
		s := redis.NewSentinelClient(&redis.Options{Addr: addr})
		hostPort, err := s.GetMasterAddrByName(ctx, "keel").Result()
		s.Close()
		if err == nil && len(hostPort) == 2 && hostPort[1] != fmt.Sprint(g.master.port) {
			votes++
		}
	}
	return votes >= 2
}

// TestSentinelFailover kills the master mid-run; a replica takes over and
// keel goes on with every job run once.
func TestSentinelFailover(t *testing.T) {
	t.Parallel()
	needRedisTools(t)
	g := startSentinelGroup(t)
	fig := failoverRun(t, failoverTarget{
		url:      g.url(),
		isolate:  func(t *testing.T) { cutReplicas(t, g.master, g.replicas...) },
		kill:     func(t *testing.T) { killMaster(t, g.master, g.replicas...) },
		promoted: g.promoted,
	})
	t.Logf("Sentinel failover: %s", fig)
}
