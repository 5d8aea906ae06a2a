package flow

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts read the time from Redis (TIME), so every worker judges leases
// and rates by one clock, whatever its own says. Each touches one key, whose
// hash tag is the rule's name, so they run on Redis Cluster too.

// acquireScript takes a concurrency slot. The slots are a sorted set: member
// = holder token, score = lease expiry in Redis milliseconds. Expired
// members are dropped first, which is how a dead worker's slot comes back.
//
// KEYS[1] slots; ARGV[1] limit, ARGV[2] lease (ms), ARGV[3] token.
// Returns 1 when the token holds a slot, 0 when all are taken.
var acquireScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[3])
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
`)

// renewScript extends a held slot's lease. One that expired but is still
// there was never counted as free, so extending it is safe. A member that
// is gone was dropped as expired by someone's acquire, or lost with Redis's
// data (a restart without persistence, a failover, a flush): it is added
// back while the slots have room, so the holders rebuild a lost set within
// a renewal, and counted lost only when they are full (its slot given to
// another job).
//
// KEYS[1] slots; ARGV[1] lease (ms), ARGV[2] token, ARGV[3] limit.
// Returns 1, or 0 if lost.
var renewScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('PEXPIRE', KEYS[1], lease)
end
return 1
`)

// reserveScript is GCRA (the generic cell rate algorithm): the key holds
// the theoretical arrival time (TAT) of the next start, in Redis
// microseconds. A start is allowed at TAT - tolerance; each start pushes TAT
// one interval further. A start that is due within max_wait is reserved now
// and its wait returned, so the caller sleeps until its turn instead of
// racing the others; a later one reserves nothing. The key expires when TAT
// passes, as an absent key means the same.
//
// KEYS[1] rate; ARGV[1] interval (µs), ARGV[2] tolerance (µs), ARGV[3]
// max_wait (µs). Returns {1, wait µs} when reserved, {0, wait µs} when not.
var reserveScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then
  tat = now
end
local wait = tat - tonumber(ARGV[2]) - now
if wait < 0 then
  wait = 0
end
if wait > tonumber(ARGV[3]) then
  return {0, wait}
end
local new_tat = tat + tonumber(ARGV[1])
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return {1, wait}
`)

// keys returns a rule's Redis keys. The braces make the name the hash tag.
func keys(prefix, name string) (slots, rate string) {
	base := prefix + "{" + name + "}:"
	return base + "slots", base + "rate"
}

func (c *Controller) tryAcquire(ctx context.Context, r *rule, token string) (bool, error) {
	n, err := acquireScript.Run(ctx, c.rdb, []string{r.slotsKey}, r.Concurrency, c.cfg.Lease.Milliseconds(), token).Int()
	if err != nil {
		return false, fmt.Errorf("acquire slot: %w", err)
	}
	return n == 1, nil
}

func (c *Controller) renew(ctx context.Context, r *rule, token string) (bool, error) {
	n, err := renewScript.Run(ctx, c.rdb, []string{r.slotsKey}, c.cfg.Lease.Milliseconds(), token, r.Concurrency).Int()
	if err != nil {
		return false, fmt.Errorf("renew slot: %w", err)
	}
	return n == 1, nil
}

func (c *Controller) releaseSlot(ctx context.Context, r *rule, token string) error {
	if err := c.rdb.ZRem(ctx, r.slotsKey, token).Err(); err != nil {
		return fmt.Errorf("release slot: %w", err)
	}
	return nil
}

// tryReserve reserves a start within maxWait. It returns whether it did and
// how long until the start is (or would be) due.
func (c *Controller) tryReserve(ctx context.Context, r *rule, maxWait time.Duration) (bool, time.Duration, error) {
	res, err := reserveScript.Run(ctx, c.rdb, []string{r.rateKey}, r.intervalUS, r.toleranceUS, maxWait.Microseconds()).Int64Slice()
	if err != nil {
		return false, 0, fmt.Errorf("take rate token: %w", err)
	}
	if len(res) != 2 {
		return false, 0, fmt.Errorf("take rate token: unexpected reply %v", res)
	}
	return res[0] == 1, time.Duration(res[1]) * time.Microsecond, nil
}
