package redisconn_test

import (
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/redisconn"
)

// Only cluster options change; the made client is still the cluster client
// asynq and keel expect. Following a failover is tested against a real
// cluster in internal/scaleout (TestClusterClientFollowsFailover).
func TestFollow(t *testing.T) {
	single := asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}
	sentinel := asynq.RedisFailoverClientOpt{MasterName: "keel", SentinelAddrs: []string{"127.0.0.1:26379"}}
	require.Equal(t, single, redisconn.Follow(single))
	require.Equal(t, sentinel, redisconn.Follow(sentinel))
	require.Nil(t, redisconn.Follow(nil))

	cluster := asynq.RedisClusterClientOpt{Addrs: []string{"127.0.0.1:7000"}, Password: "pw"}
	for _, opt := range []asynq.RedisConnOpt{cluster, &cluster} {
		followed := redisconn.Follow(opt)
		require.NotEqual(t, opt, followed)
		require.Equal(t, followed, redisconn.Follow(followed), "following twice changes nothing")
		c, ok := followed.MakeRedisClient().(*redis.ClusterClient)
		require.True(t, ok)
		require.Equal(t, "pw", c.Options().Password)
		require.NoError(t, c.Close())
	}
	var nilCluster *asynq.RedisClusterClientOpt
	require.Equal(t, asynq.RedisConnOpt(nilCluster), redisconn.Follow(nilCluster))
}
