// Package redisconn adjusts the Redis connection options keel's components
// are given, so that every client keel makes behaves the same on a failover.
package redisconn

import (
	"context"
	"errors"
	"io"
	"net"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Follow returns opt, with a Redis Cluster option replaced by one whose
// clients follow a failover at once. go-redis reloads a cluster's slot map
// on MOVED replies and every ClusterStateReloadInterval (a minute), not
// when a master stops answering: after its replica is promoted, commands
// for its slots would go on failing against the dead address for up to a
// minute. These clients read the slot map again as soon as a node cannot be
// reached. Other options are returned as they are (a Sentinel client
// already follows the sentinels' +switch-master).
func Follow(opt asynq.RedisConnOpt) asynq.RedisConnOpt {
	switch o := opt.(type) {
	case asynq.RedisClusterClientOpt:
		return clusterOpt{o}
	case *asynq.RedisClusterClientOpt:
		if o != nil {
			return clusterOpt{*o}
		}
	}
	return opt
}

// clusterOpt is a cluster option whose clients reload the slot map when a
// node cannot be reached.
type clusterOpt struct{ asynq.RedisClusterClientOpt }

// MakeRedisClient returns a *redis.ClusterClient, as asynq's option does.
func (o clusterOpt) MakeRedisClient() any {
	c := o.RedisClusterClientOpt.MakeRedisClient().(*redis.ClusterClient)
	// Node clients are made lazily, from the first command on, so each
	// gets the hook.
	c.OnNewNode(func(node *redis.Client) { node.AddHook(reloadHook{c}) })
	return c
}

// reloadHook asks its cluster client for a new slot map when its node
// cannot be dialled or a connection to it breaks. Reloads are coalesced by
// go-redis (one at a time, at most one every 200ms).
type reloadHook struct{ cluster *redis.ClusterClient }

func (h reloadHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil {
			h.cluster.ReloadState(ctx)
		}
		return conn, err
	}
}

func (h reloadHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.check(ctx, err)
		return err
	}
}

func (h reloadHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.check(ctx, err)
		return err
	}
}

// check reloads after a network error: the node may be gone.
func (h reloadHook) check(ctx context.Context, err error) {
	var ne net.Error
	if errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		h.cluster.ReloadState(ctx)
	}
}
