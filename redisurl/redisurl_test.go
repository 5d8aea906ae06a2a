package redisurl_test

import (
	"context"
	"crypto/tls"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/redisurl"
)

var parseCases = []struct {
	name string
	in   string
	want asynq.RedisConnOpt
}{
	// redis://
	{"host and port", "redis://127.0.0.1:6379", asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}},
	{"default port", "redis://localhost", asynq.RedisClientOpt{Addr: "localhost:6379"}},
	{"password and db", "redis://:secret@cache:6380/2", asynq.RedisClientOpt{Addr: "cache:6380", Password: "secret", DB: 2}},
	{"user and password", "redis://app:secret@cache/3", asynq.RedisClientOpt{Addr: "cache:6379", Username: "app", Password: "secret", DB: 3}},
	{"user with empty password", "redis://app:@cache", asynq.RedisClientOpt{Addr: "cache:6379", Username: "app"}},
	{"percent-encoded password", "redis://:p%40ss%2Fw%3Fd%23@cache", asynq.RedisClientOpt{Addr: "cache:6379", Password: "p@ss/w?d#"}},
	{"unencoded @ in password", "redis://:p@ss@cache", asynq.RedisClientOpt{Addr: "cache:6379", Password: "p@ss"}},
	{"colon in password", "redis://app:a:b@cache", asynq.RedisClientOpt{Addr: "cache:6379", Username: "app", Password: "a:b"}},
	{"trailing slash", "redis://cache:6379/", asynq.RedisClientOpt{Addr: "cache:6379"}},
	{"db with trailing slash", "redis://cache/4/", asynq.RedisClientOpt{Addr: "cache:6379", DB: 4}},
	{"ipv6", "redis://[::1]:6379/1", asynq.RedisClientOpt{Addr: "[::1]:6379", DB: 1}},
	{"ipv6 default port", "redis://[::1]", asynq.RedisClientOpt{Addr: "[::1]:6379"}},
	{"upper-case scheme", "REDIS://Cache:6379", asynq.RedisClientOpt{Addr: "Cache:6379"}},
	{"surrounding space", "  redis://cache:1/0\n", asynq.RedisClientOpt{Addr: "cache:1"}},
	{"underscore in host", "redis://keel_redis_1:6379", asynq.RedisClientOpt{Addr: "keel_redis_1:6379"}},

	// rediss://
	{"tls", "rediss://:pw@cache.example.com:6380/0", asynq.RedisClientOpt{
		Addr: "cache.example.com:6380", Password: "pw",
		TLSConfig: &tls.Config{ServerName: "cache.example.com", MinVersion: tls.VersionTLS12},
	}},
	{"tls ipv6", "rediss://[::1]", asynq.RedisClientOpt{
		Addr: "[::1]:6379", TLSConfig: &tls.Config{ServerName: "::1", MinVersion: tls.VersionTLS12},
	}},

	// redis-socket://
	{"socket", "redis-socket:///var/run/redis/redis.sock", asynq.RedisClientOpt{Network: "unix", Addr: "/var/run/redis/redis.sock"}},
	{"socket with password and db", "redis-socket://:pw@/tmp/redis.sock?db=3", asynq.RedisClientOpt{Network: "unix", Addr: "/tmp/redis.sock", Password: "pw", DB: 3}},
	{"socket with encoded space", "redis-socket:///tmp/my%20redis.sock", asynq.RedisClientOpt{Network: "unix", Addr: "/tmp/my redis.sock"}},

	// redis-sentinel://
	{"sentinel", "redis-sentinel://s1:26379,s2:26380,s3?master=mymaster", asynq.RedisFailoverClientOpt{
		MasterName: "mymaster", SentinelAddrs: []string{"s1:26379", "s2:26380", "s3:26379"},
	}},
	{"sentinel with every option", "redis-sentinel://app:pw@s1,[::1]:5000/2?master=m&sentinel_username=su&sentinel_password=sp", asynq.RedisFailoverClientOpt{
		MasterName: "m", SentinelAddrs: []string{"s1:26379", "[::1]:5000"},
		SentinelUsername: "su", SentinelPassword: "sp", Username: "app", Password: "pw", DB: 2,
	}},
	{"sentinel password with @", "redis-sentinel://s1?master=m&sentinel_password=a@b", asynq.RedisFailoverClientOpt{
		MasterName: "m", SentinelAddrs: []string{"s1:26379"}, SentinelPassword: "a@b",
	}},

	// redis-cluster://
	{"cluster", "redis-cluster://n1:7000,n2:7001,n3", asynq.RedisClusterClientOpt{Addrs: []string{"n1:7000", "n2:7001", "n3:6379"}}},
	{"cluster one node", "redis-cluster://n1:7000", asynq.RedisClusterClientOpt{Addrs: []string{"n1:7000"}}},
	{"cluster with auth and db 0", "redis-cluster://app:pw@n1:7000/0", asynq.RedisClusterClientOpt{Addrs: []string{"n1:7000"}, Username: "app", Password: "pw"}},
	{"cluster ipv6", "redis-cluster://[::1]:7000,[fe80::1]:7001", asynq.RedisClusterClientOpt{Addrs: []string{"[::1]:7000", "[fe80::1]:7001"}}},
}

func TestParse(t *testing.T) {
	t.Parallel()
	for _, tc := range parseCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := redisurl.Parse(tc.in)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

var badCases = []struct {
	name    string
	in      string
	wantErr string // a part of the error message
}{
	{"empty", "", "REDIS_URL is empty (want e.g. redis://127.0.0.1:6379/0)"},
	{"blank", " \t\n", "REDIS_URL is empty"},
	{"unsupported scheme", "foo://x", `REDIS_URL "foo://x": unsupported scheme "foo" (want redis, rediss, redis-socket, redis-sentinel or redis-cluster)`},
	{"http", "http://cache", `unsupported scheme "http"`},
	{"no scheme", "localhost:6379", `REDIS_URL "localhost:6379": not a URL (want e.g. redis://127.0.0.1:6379/0)`},
	{"empty scheme", "://cache", "malformed scheme"},
	{"bad scheme", "re dis://cache", "malformed scheme"},
	{"control character", "redis://ca\x00che", "control character"},

	{"no host", "redis://", "missing host (want redis://HOST:PORT/DB)"},
	{"no host with db", "redis:///0", "missing host"},
	{"no host with password", "redis://:pw@/0", "missing host"},
	{"tls no host", "rediss://", "missing host (want rediss://HOST:PORT/DB)"},
	{"port only", "redis://:6379", `address ":6379": missing host name`},
	{"db not a number", "redis://cache/abc", `database "abc" is not a number`},
	{"negative db", "redis://cache/-1", `database "-1" is not a number`},
	{"plus db", "redis://cache/+1", `database "+1" is not a number`},
	{"huge db", "redis://cache/99999999999999999999", `database "99999999999999999999" is out of range`},
	{"path after db", "redis://cache/0/1", `unexpected path "/0/1"`},
	{"port not a number", "redis://cache:abc", `address "cache:abc": bad port "abc" (want 1-65535)`},
	{"port zero", "redis://cache:0", `bad port "0"`},
	{"port too big", "redis://cache:65536", `bad port "65536"`},
	{"port far too big", "redis://cache:99999999999999999999999", `bad port`},
	{"empty port", "redis://cache:", `address "cache:": empty port`},
	{"several hosts", "redis://h1,h2", "redis:// takes one host; use redis-sentinel:// or redis-cluster:// for several"},
	{"query on redis", "redis://cache?db=1", `unknown query parameter "db" (redis:// takes none)`},
	{"bad query", "redis://cache?a=%zz", "malformed query string"},
	{"user without password", "redis://secret@cache", "user info without a password: write redis://:PASSWORD@HOST"},
	{"unencoded slash in password", "redis://:ab/cd@cache", `percent-encode them as %2F and %3F`},
	{"unencoded question mark in password", "redis://:ab?cd@cache", `percent-encode them as %2F and %3F`},
	{"hash", "redis://:ab#cd@cache", `unexpected "#": percent-encode it as %23`},
	{"bad escape in password", "redis://:%zz@cache", "bad percent-encoding in the password"},
	{"bad escape in user", "redis://%zz:pw@cache", "bad percent-encoding in the user name"},
	{"bare ipv6", "redis://::1:6379", "write an IPv6 address in brackets"},
	{"unclosed bracket", "redis://[::1", `address "[::1": missing ']'`},
	{"not ipv6 in brackets", "redis://[cache]:1", `"cache" in brackets is not an IPv6 address`},
	{"ipv4 in brackets", "redis://[127.0.0.1]:1", "is not an IPv6 address"},
	{"junk after bracket", "redis://[::1]x", `unexpected "x" after ']'`},
	{"space in host", "redis://ca che:1", `invalid character ' ' in host name`},

	{"socket with two slashes", "redis-socket://tmp/redis.sock", `unexpected host "tmp": the socket path must be absolute`},
	{"socket no path", "redis-socket://", "missing socket path"},
	{"socket root", "redis-socket:///", "missing socket path"},
	{"socket db not a number", "redis-socket:///tmp/redis.sock?db=x", `database "x" is not a number`},
	{"socket empty db", "redis-socket:///tmp/redis.sock?db=", "empty database number"},
	{"socket two dbs", "redis-socket:///tmp/redis.sock?db=1&db=2", `query parameter "db" given 2 times`},
	{"socket unknown param", "redis-socket:///tmp/redis.sock?foo=1", `unknown query parameter "foo" (redis-socket:// takes db)`},
	{"socket directory", "redis-socket:///tmp/dir/", `socket path "/tmp/dir/" ends in a slash`},
	{"socket bad escape", "redis-socket:///tmp/%zz", "bad percent-encoding in the socket path"},

	{"sentinel without master", "redis-sentinel://s1,s2", "missing master name (add ?master=NAME"},
	{"sentinel empty master", "redis-sentinel://s1?master=", "missing master name"},
	{"sentinel no addresses", "redis-sentinel://?master=m", "no addresses (want redis-sentinel://HOST1:PORT,HOST2:PORT,...)"},
	{"sentinel empty address", "redis-sentinel://s1,,s2?master=m", "address 2 of 3 is empty"},
	{"sentinel two masters", "redis-sentinel://s1?master=a&master=b", `query parameter "master" given 2 times`},
	{"sentinel bad db", "redis-sentinel://s1/x?master=m", `database "x" is not a number`},
	{"sentinel bad port", "redis-sentinel://s1:1,s2:x?master=m", `address "s2:x": bad port "x"`},
	{"sentinel unknown param", "redis-sentinel://s1?master=m&password=p", `unknown query parameter "password" (redis-sentinel:// takes master, sentinel_username, sentinel_password)`},

	{"cluster no addresses", "redis-cluster://", "no addresses (want redis-cluster://HOST1:PORT,HOST2:PORT,...)"},
	{"cluster only auth", "redis-cluster://:pw@", "no addresses"},
	{"cluster trailing comma", "redis-cluster://n1,", "address 2 of 2 is empty"},
	{"cluster only commas", "redis-cluster://,,", "address 1 of 3 is empty"},
	{"cluster bad port", "redis-cluster://n1:7000,n2:bad", `address "n2:bad": bad port "bad"`},
	{"cluster db", "redis-cluster://n1/1", "database 1: Redis Cluster has only database 0"},
	{"cluster query", "redis-cluster://n1?readonly=true", `unknown query parameter "readonly" (redis-cluster:// takes none)`},
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range badCases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := redisurl.Parse(tc.in)
			require.Error(t, err)
			require.Nil(t, got)
			require.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

func TestParseErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"redis://:hunter2@cache/abc",
		"redis://app:hunter2@cache:bad",
		"redis://hunter2@cache",
		"redis://:hunter2@",
		"redis://:hun/ter2@cache",
		"redis://:hun?ter2@cache",
		"redis://:hunter2#@cache",
		"redis://:hunter2@cache?a=%zz",
		"redis://:hunter2%zz@cache",
		"redis-socket://:hunter2@tmp/redis.sock",
		"redis-sentinel://:hunter2@s1?master=m&sentinel_password=hunter2&x=1",
		"redis-sentinel://s1?sentinel_password=hunter2",
		"redis-sentinel://s1?sentinel_password=hun%zzter2&master=m",
		"redis-cluster://:hunter2@n1/5",
		"hunter2@cache:6379",
		"foo://:hunter2@cache",
	} {
		_, err := redisurl.Parse(in)
		require.Error(t, err, in)
		require.NotContains(t, err.Error(), "hunter2", in)
		require.NotContains(t, err.Error(), "hun", in)
	}
}

func TestRedact(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"redis://cache:6379/0", "redis://cache:6379/0"},
		{"redis://:secret@cache:6379/0", "redis://:xxxxx@cache:6379/0"},
		{"redis://app:secret@cache", "redis://app:xxxxx@cache"},
		{"redis://app:@cache", "redis://app:@cache"},
		{"redis://secret@cache", "redis://xxxxx@cache"},
		{"redis://:p@ss@cache", "redis://:xxxxx@cache"},
		{"redis://:ab/cd@cache", "redis://:xxxxx@cache"},
		{"redis://app:a:b@cache", "redis://app:xxxxx@cache"},
		{"redis-socket://:pw@/tmp/redis.sock?db=1", "redis-socket://:xxxxx@/tmp/redis.sock?db=1"},
		{"redis-sentinel://:pw@s1,s2?master=m&sentinel_password=sp", "redis-sentinel://:xxxxx@s1,s2?master=m&sentinel_password=xxxxx"},
		{"redis-sentinel://s1?sentinel_password=sp&master=m", "redis-sentinel://s1?sentinel_password=xxxxx&master=m"},
		{"redis-sentinel://s1?SENTINEL_PASSWORD=sp", "redis-sentinel://s1?SENTINEL_PASSWORD=xxxxx"},
		{"redis-sentinel://s1?sentinel_password=a@b&master=m", "redis-sentinel://xxxxx&master=m"},
		{"postgres://postgres:keel@postgres:5432/keel?sslmode=disable", "postgres://postgres:xxxxx@postgres:5432/keel?sslmode=disable"},
		// In a Postgres URL user info without ":" is the user name, which
		// pgx's own errors show anyway.
		{"postgres://postgres@127.0.0.1:5432/keel?sslmode=disable", "postgres://postgres@127.0.0.1:5432/keel?sslmode=disable"},
		{"postgresql://bob@db/keel", "postgresql://bob@db/keel"},
		{"POSTGRES://bob@db/keel", "POSTGRES://bob@db/keel"},
		{"postgres://bob:pw@db/keel", "postgres://bob:xxxxx@db/keel"},
		{"postgres://bob@db/keel?password=pw", "postgres://bob@db/keel?password=xxxxx"},
		{"postgres://db/keel?password=a@b", "postgres://xxxxx"},
		{"user:pw@cache:6379", "user:xxxxx@cache:6379"},
		{"pw@cache:6379", "xxxxx@cache:6379"},
		{"cache:6379", "cache:6379"},
		{"not a url at all", "not a url at all"},
		{"\xfapAssword=x", "\xfapAssword=xxxxx"}, // not UTF-8: byte offsets must hold
		{"\u0130password=x&y", "\u0130password=xxxxx&y"},
	} {
		require.Equal(t, tc.want, redisurl.Redact(tc.in), tc.in)
	}
}

// TestParseConnects checks that a parsed URL reaches the test Redis
// (KEEL_TEST_REDIS_ADDR, default 127.0.0.1:6379). It only pings.
func TestParseConnects(t *testing.T) {
	t.Parallel()
	addr := os.Getenv("KEEL_TEST_REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	opt, err := redisurl.Parse("redis://" + addr + "/0")
	require.NoError(t, err)
	client, ok := opt.MakeRedisClient().(redis.UniversalClient)
	require.True(t, ok)
	t.Cleanup(func() { _ = client.Close() })

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, client.Ping(ctx).Err())
}

func FuzzParse(f *testing.F) {
	for _, tc := range parseCases {
		f.Add(tc.in)
	}
	for _, tc := range badCases {
		f.Add(tc.in)
	}
	f.Fuzz(func(t *testing.T, s string) {
		opt, err := redisurl.Parse(s)
		if (opt == nil) == (err == nil) {
			t.Fatalf("Parse(%q) = %v, %v: want exactly one of an option and an error", s, opt, err)
		}
		if err != nil && !strings.HasPrefix(err.Error(), "REDIS_URL ") {
			t.Fatalf("Parse(%q): error %q does not start with REDIS_URL", s, err)
		}
		_ = redisurl.Redact(s)
	})
}
