package flow_test

import (
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/flow"
)

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()

	ok := flow.Rule{Name: "reports", Kinds: []string{"report:generate"}, Concurrency: 5}
	tests := []struct {
		name string
		cfg  flow.Config
		want []string // each must appear in the error
	}{
		{name: "no rules", cfg: flow.Config{}, want: []string{"no rules"}},
		{name: "empty name", cfg: flow.Config{Rules: []flow.Rule{{Concurrency: 1}}},
			want: []string{"rule 0: Name is required"}},
		{name: "brace in name", cfg: flow.Config{Rules: []flow.Rule{{Name: "a{b}", Concurrency: 1}}},
			want: []string{`rule "a{b}": Name must not contain`}},
		{name: "long name", cfg: flow.Config{Rules: []flow.Rule{{Name: string(make([]byte, 201)), Concurrency: 1}}},
			want: []string{"longer than 200 bytes"}},
		{name: "duplicate name", cfg: flow.Config{Rules: []flow.Rule{ok, ok}},
			want: []string{`rule "reports" is defined twice`}},
		{name: "limits nothing", cfg: flow.Config{Rules: []flow.Rule{{Name: "x"}}},
			want: []string{`rule "x": limits nothing`}},
		{name: "negative concurrency", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Concurrency: -1}}},
			want: []string{"Concurrency must not be negative, got -1"}},
		{name: "negative rate", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Rate: -5}}},
			want: []string{"Rate must not be negative, got -5"}},
		{name: "negative period", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Rate: 1, Period: -time.Second}}},
			want: []string{"Period must not be negative"}},
		{name: "negative burst", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Rate: 1, Burst: -1}}},
			want: []string{"Burst must not be negative"}},
		{name: "burst without rate", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Concurrency: 1, Burst: 3}}},
			want: []string{"Period and Burst need a Rate"}},
		{name: "rate too fine", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Rate: 2_000_000}}},
			want: []string{"more than one per microsecond"}},
		{name: "empty kind", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Kinds: []string{""}, Concurrency: 1}}},
			want: []string{"empty kind"}},
		{name: "kind twice", cfg: flow.Config{Rules: []flow.Rule{{Name: "x", Kinds: []string{"a", "a"}, Concurrency: 1}}},
			want: []string{`kind "a" is listed twice`}},
		{name: "short lease", cfg: flow.Config{Rules: []flow.Rule{ok}, Lease: time.Millisecond},
			want: []string{"Lease must be at least 100ms"}},
		{name: "negative hold", cfg: flow.Config{Rules: []flow.Rule{ok}, Hold: -time.Second},
			want: []string{"Hold must not be negative"}},
		{name: "negative recheck", cfg: flow.Config{Rules: []flow.Rule{ok}, Recheck: -time.Second},
			want: []string{"Recheck must not be negative"}},
		{name: "brace in prefix", cfg: flow.Config{Rules: []flow.Rule{ok}, Prefix: "app{1}:"},
			want: []string{"Prefix"}},
		{name: "every problem at once", cfg: flow.Config{Rules: []flow.Rule{{Concurrency: -1}, {Name: "y", Rate: -1}}, Lease: time.Nanosecond},
			want: []string{"Name is required", "Concurrency must not be negative", `rule "y": Rate must not be negative`, "Lease"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.cfg.Redis = asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}
			require.Error(t, tt.cfg.Validate())
			c, err := flow.New(tt.cfg)
			require.Nil(t, c)
			require.Error(t, err)
			for _, w := range tt.want {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

func TestNewNeedsRedis(t *testing.T) {
	t.Parallel()
	cfg := flow.Config{Rules: []flow.Rule{{Name: "x", Concurrency: 1}}}
	require.ErrorContains(t, cfg.Validate(), "flow.Config.Redis is required")
	c, err := flow.New(cfg)
	require.ErrorContains(t, err, "flow.Config.Redis is required")
	require.Nil(t, c)

	// Everything wrong is told at once.
	_, err = flow.New(flow.Config{Lease: time.Nanosecond})
	require.ErrorContains(t, err, "Redis is required")
	require.ErrorContains(t, err, "no rules")
	require.ErrorContains(t, err, "Lease")

	cfg.Redis = oddRedisOpt{}
	c, err = flow.New(cfg)
	require.ErrorContains(t, err, "oddRedisOpt")
	require.Nil(t, c)
}

// oddRedisOpt is a RedisConnOpt that makes no go-redis client.
type oddRedisOpt struct{}

func (oddRedisOpt) MakeRedisClient() any { return "not a client" }

func TestValidAConfigWithRedisAndARule(t *testing.T) {
	t.Parallel()
	require.NoError(t, flow.Config{Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"},
		Rules: []flow.Rule{{Name: "x", Concurrency: 1}}}.Validate())
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	cfg := flow.Config{Rules: []flow.Rule{{Name: "mail", Rate: 50}, {Name: "reports", Concurrency: 5}}}.WithDefaults()
	require.Equal(t, flow.DefaultLease, cfg.Lease)
	require.Equal(t, flow.DefaultHold, cfg.Hold)
	require.Equal(t, flow.DefaultRecheck, cfg.Recheck)
	require.Equal(t, flow.DefaultPrefix, cfg.Prefix)
	require.NotNil(t, cfg.Logger)
	require.NotNil(t, cfg.Rand)
	require.Equal(t, flow.Rule{Name: "mail", Rate: 50, Period: flow.DefaultPeriod, Burst: flow.DefaultBurst}, cfg.Rules[0])
	require.Equal(t, flow.Rule{Name: "reports", Concurrency: 5}, cfg.Rules[1], "no rate, so no period or burst")
	require.Equal(t, flow.NoHold, flow.Config{Hold: flow.NoHold}.WithDefaults().Hold)
}
