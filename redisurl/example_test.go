package redisurl_test

import (
	"fmt"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/redisurl"
)

func ExampleParse() {
	opt, err := redisurl.Parse("redis-cluster://:secret@node1:7000,node2:7001,node3")
	if err != nil {
		fmt.Println(err)
		return
	}
	cluster := opt.(asynq.RedisClusterClientOpt)
	fmt.Println(cluster.Addrs)

	_, err = redisurl.Parse("redis://:secret@cache:6379/one")
	fmt.Println(err)
	// Output:
	// [node1:7000 node2:7001 node3:6379]
	// REDIS_URL "redis://:xxxxx@cache:6379/one": database "one" is not a number
}

func ExampleRedact() {
	fmt.Println(redisurl.Redact("redis://app:secret@cache:6379/0"))
	// Output: redis://app:xxxxx@cache:6379/0
}
