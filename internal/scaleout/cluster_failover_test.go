package scaleout_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/redisurl"
)

// replicatedCluster is a Redis Cluster of three masters with a replica each.
type replicatedCluster struct {
	nodes map[string]*redisProc // by address
	addrs []string
}

// startReplicatedCluster starts six nodes and makes them a cluster of three
// masters and three replicas that fail a node after a second of silence.
func startReplicatedCluster(t *testing.T) *replicatedCluster {
	t.Helper()
	c := &replicatedCluster{nodes: map[string]*redisProc{}}
	for range 6 {
		p := spawnRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000")
		c.nodes[p.addr()] = p
		c.addrs = append(c.addrs, p.addr())
	}
	out, err := exec.Command("redis-cli", append(append([]string{"--cluster", "create"}, c.addrs...),
		"--cluster-replicas", "1", "--cluster-yes")...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	// Ready when every node sees the cluster ok and every slot range has a
	// replica whose link to its master is up.
	deadline := time.Now().Add(30 * time.Second)
	for !c.ready() {
		if time.Now().After(deadline) {
			t.Fatal("the cluster never had three masters with a synced replica each")
		}
		time.Sleep(100 * time.Millisecond)
	}
	return c
}

func (c *replicatedCluster) ready() bool {
	ctx := context.Background()
	for _, a := range c.addrs {
		n := redis.NewClient(&redis.Options{Addr: a})
		info, err := n.ClusterInfo(ctx).Result()
		repl, err2 := n.Info(ctx, "replication").Result()
		n.Close()
		if err != nil || err2 != nil || !strings.Contains(info, "cluster_state:ok") {
			return false
		}
		if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
			return false
		}
	}
	ranges, err := c.slots(ctx, c.addrs[0])
	if err != nil || len(ranges) != 3 {
		return false
	}
	for _, r := range ranges {
		if len(r.Nodes) != 2 {
			return false
		}
	}
	return true
}

func (c *replicatedCluster) slots(ctx context.Context, addr string) ([]redis.ClusterSlot, error) {
	n := redis.NewClient(&redis.Options{Addr: addr})
	defer n.Close()
	return n.ClusterSlots(ctx).Result()
}

// owner returns the master serving key's slot and its replica.
func (c *replicatedCluster) owner(t *testing.T, key string) (master, replica *redisProc) {
	t.Helper()
	ctx := context.Background()
	n := redis.NewClient(&redis.Options{Addr: c.addrs[0]})
	defer n.Close()
	slot, err := n.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	ranges, err := c.slots(ctx, c.addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range ranges {
		if int64(r.Start) <= slot && slot <= int64(r.End) {
			return c.nodes[r.Nodes[0].Addr], c.nodes[r.Nodes[1].Addr]
		}
	}
	t.Fatalf("no node serves slot %d", slot)
	return nil, nil
}

func (c *replicatedCluster) url() string { return "redis-cluster://" + strings.Join(c.addrs, ",") }

// TestClusterFailover kills the master of one queue's slot mid-run; its
// replica takes over and keel goes on with every job run once.
func TestClusterFailover(t *testing.T) {
	t.Parallel()
	needRedisTools(t)
	c := startReplicatedCluster(t)
	// asynq's keys of a queue carry the queue's name as hash tag.
	master, replica := c.owner(t, "asynq:{"+lostQueue+"}:pending")
	fig := failoverRun(t, failoverTarget{
		url:     c.url(),
		isolate: func(t *testing.T) { cutReplicas(t, master, replica) },
		kill:    func(t *testing.T) { killMaster(t, master, replica) },
		promoted: func(ctx context.Context) bool {
			n := redis.NewClient(&redis.Options{Addr: replica.addr()})
			defer n.Close()
			role, err1 := n.Do(ctx, "ROLE").Slice()
			info, err2 := n.ClusterInfo(ctx).Result()
			return err1 == nil && err2 == nil && len(role) > 0 && role[0] == "master" && strings.Contains(info, "cluster_state:ok")
		},
	})
	t.Logf("Cluster failover: %s", fig)
	var alive []string
	for _, a := range c.addrs {
		if a != master.addr() {
			alive = append(alive, a)
		}
	}
	noCrossSlot(t, alive...)
}

// The cluster clients keel makes follow a promotion at once: a command to
// the dead master's slot makes them read the slot map again, where
// go-redis's own client keeps the dead node until its next periodic reload
// (a minute).
func TestClusterClientFollowsFailover(t *testing.T) {
	t.Parallel()
	needRedisTools(t)
	c := startReplicatedCluster(t)
	ctx := context.Background()
	const key = "follow:{" + lostQueue + "}"
	master, replica := c.owner(t, key)
	opt, err := redisurl.Parse(c.url())
	require.NoError(t, err)
	rc := redisconn.Follow(opt).MakeRedisClient().(redis.UniversalClient)
	defer rc.Close()
	require.NoError(t, rc.Set(ctx, key, "before", 0).Err())

	killMaster(t, master)
	testenv.Eventually(t, 30*time.Second, func() bool {
		n := redis.NewClient(&redis.Options{Addr: replica.addr()})
		defer n.Close()
		role, err := n.Do(ctx, "ROLE").Slice()
		return err == nil && len(role) > 0 && role[0] == "master"
	}, "the replica never took over")
	testenv.Eventually(t, 10*time.Second, func() bool {
		return rc.Set(ctx, key, "after", 0).Err() == nil
	}, "the client still writes to the dead master")
}
