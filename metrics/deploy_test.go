package metrics_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/server"
)

// exported returns every series name keel's collectors can produce,
// including a histogram's _bucket, _sum and _count.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	reg := prometheus.NewRegistry()
	// A declared kind: its counters are gathered before any job ran.
	w, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg, DuplicatesSkipped: func() uint64 { return 0 },
		Guard: func() server.GuardStats { return server.GuardStats{} }, Kinds: []metrics.Kind{{Name: "k", Queue: "default"}}})
	require.NoError(t, err)
	names := map[string]bool{}
	// The Ledger is only described, never collected: no database needed.
	descs := make(chan *prometheus.Desc, 100)
	newLedger(t, metrics.LedgerConfig{}).Describe(descs)
	close(descs)
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	for d := range descs {
		m := fq.FindStringSubmatch(d.String())
		require.NotNil(t, m, d.String())
		names[m[1]] = true
	}
	// Every counter of the options, a new one too: one left out here would
	// never be checked against the panels.
	opts := metrics.OutboxOptions{PrunedByKind: onePruned, DeadLettersToDrop: oneToDrop}
	zero := reflect.ValueOf(func() uint64 { return 0 })
	for v, i := reflect.ValueOf(&opts).Elem(), 0; i < v.NumField(); i++ {
		if f := v.Field(i); f.Type() == zero.Type() {
			f.Set(zero)
		}
	}
	require.NoError(t, metrics.RegisterOutbox(reg, opts))
	// One attempt so that the duration histogram has a series to gather.
	h := w.Middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	require.NoError(t, h.ProcessTask(context.Background(), asynq.NewTask("k", nil)))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		names[mf.GetName()] = true
		if mf.GetType() == dto.MetricType_HISTOGRAM {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				names[mf.GetName()+suffix] = true
			}
		}
	}
	return names
}

var keelName = regexp.MustCompile(`\bkeel_[a-z0-9_]+`)

// unknownNames lists the keel_ metric names expr uses that keel does not export.
func unknownNames(expr string, known map[string]bool) []string {
	var out []string
	for _, n := range keelName.FindAllString(expr, -1) {
		if !known[n] {
			out = append(out, n)
		}
	}
	return out
}

func deployFile(t *testing.T, parts ...string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(append([]string{"..", "deploy"}, parts...)...))
	require.NoError(t, err)
	return b
}

func TestAlertRules(t *testing.T) {
	t.Parallel()
	known := exported(t)
	var file struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	dec := yaml.NewDecoder(strings.NewReader(string(deployFile(t, "prometheus", "alerts.yml"))))
	dec.KnownFields(true) // a misspelt key is an error, as it is for Prometheus
	require.NoError(t, dec.Decode(&file))
	require.NotEmpty(t, file.Groups)

	seen := map[string]bool{}
	var used []string
	for _, g := range file.Groups {
		require.NotEmpty(t, g.Name)
		require.NotEmpty(t, g.Rules, "group %s", g.Name)
		for _, r := range g.Rules {
			require.Regexp(t, `^[A-Z][A-Za-z0-9]+$`, r.Alert)
			require.False(t, seen[r.Alert], "alert %s defined twice", r.Alert)
			seen[r.Alert] = true
			require.NotEmpty(t, strings.TrimSpace(r.Expr), r.Alert)
			require.Equal(t, strings.Count(r.Expr, "("), strings.Count(r.Expr, ")"), "%s: unbalanced parentheses", r.Alert)
			require.Equal(t, strings.Count(r.Expr, "{"), strings.Count(r.Expr, "}"), "%s: unbalanced braces", r.Alert)
			if r.For != "" {
				_, err := time.ParseDuration(r.For)
				require.NoError(t, err, "%s: for", r.Alert)
			}
			require.Contains(t, []string{"warning", "critical"}, r.Labels["severity"], "%s: severity", r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], "%s: summary", r.Alert)
			require.Empty(t, unknownNames(r.Expr, known), "%s uses metrics keel does not export", r.Alert)
			used = append(used, keelName.FindAllString(r.Expr, -1)...)
		}
	}
	// The brief's five concerns each have an alert.
	for _, m := range []string{"keel_dead_letters", "keel_queue_size", "keel_queue_oldest_pending_seconds", "keel_jobs_failed_total", "keel_outbox_lag_seconds"} {
		require.Contains(t, used, m)
	}
}

func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	known := exported(t)
	var dash struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			ID      int    `json:"id"`
			Title   string `json:"title"`
			Type    string `json:"type"`
			GridPos struct {
				X, Y, W, H int
			} `json:"gridPos"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(deployFile(t, "grafana", "keel.json"), &dash))
	require.NotEmpty(t, dash.Title)
	require.NotEmpty(t, dash.UID)
	require.NotEmpty(t, dash.Panels)
	ids := map[int]bool{}
	var all []string
	for _, p := range dash.Panels {
		require.False(t, ids[p.ID], "panel id %d twice", p.ID)
		ids[p.ID] = true
		require.NotEmpty(t, p.Title)
		require.Contains(t, []string{"stat", "timeseries"}, p.Type, p.Title)
		require.LessOrEqual(t, p.GridPos.X+p.GridPos.W, 24, "%s does not fit the grid", p.Title)
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.RefID, p.Title)
			require.NotEmpty(t, keelName.FindAllString(tg.Expr, -1), "%s: a target without a keel metric", p.Title)
			require.Empty(t, unknownNames(tg.Expr, known), "%s uses metrics keel does not export", p.Title)
			all = append(all, keelName.FindAllString(tg.Expr, -1)...)
		}
	}
	for _, v := range dash.Templating.List {
		if s, ok := v.Query.(map[string]any); ok {
			require.Empty(t, unknownNames(s["query"].(string), known), "variable %s", v.Name)
		}
	}
	// Every metric keel exports is on the dashboard somewhere.
	var missing []string
	for n := range known {
		if strings.HasSuffix(n, "_sum") || strings.HasSuffix(n, "_count") || (strings.HasPrefix(n, "keel_job_duration") && !strings.HasSuffix(n, "_bucket")) {
			continue
		}
		if !contains(all, n) {
			missing = append(missing, n)
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "metrics no panel shows")
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
}
