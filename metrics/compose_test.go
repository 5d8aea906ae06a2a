package metrics_test

import (
	"encoding/json"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// composeService is the part of a docker-compose.yml service these tests
// read. YAML merge keys (<<: *keel) are resolved by the decoder, as
// Compose resolves them.
type composeService struct {
	Image       string            `yaml:"image"`
	Build       any               `yaml:"build"`
	Entrypoint  []string          `yaml:"entrypoint"`
	Command     []string          `yaml:"command"`
	Environment map[string]string `yaml:"environment"`
	Volumes     []string          `yaml:"volumes"`
	Restart     string            `yaml:"restart"`
	DependsOn   map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
	Healthcheck *struct {
		Test        []string `yaml:"test"`
		Interval    string   `yaml:"interval"`
		Timeout     string   `yaml:"timeout"`
		Retries     int      `yaml:"retries"`
		StartPeriod string   `yaml:"start_period"`
	} `yaml:"healthcheck"`
}

type composeFile struct {
	Name     string                    `yaml:"name"`
	Version  string                    `yaml:"version"`
	Services map[string]composeService `yaml:"services"`
}

func readCompose(t *testing.T) composeFile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docker-compose.yml"))
	require.NoError(t, err)
	var f composeFile
	require.NoError(t, yaml.Unmarshal(b, &f))
	require.NotEmpty(t, f.Services)
	return f
}

// keelServices are the services that run keel's image and keep running
// (migrate runs once and exits).
func keelServices(f composeFile) []string {
	var out []string
	for name, s := range f.Services {
		if s.Image == "keel:local" && s.Restart != "no" {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

func TestComposeIsForComposeV2(t *testing.T) {
	t.Parallel()
	f := readCompose(t)
	// The project name is a Compose v2 key (v1 rejects it); version is
	// obsolete in v2 and only warned about.
	require.Equal(t, "keel", f.Name)
	require.Empty(t, f.Version)
}

func TestComposeKeelServicesAreHealthChecked(t *testing.T) {
	t.Parallel()
	f := readCompose(t)
	svcs := keelServices(f)
	for _, want := range []string{"worker", "worker-reports", "scheduler", "web"} {
		require.Contains(t, svcs, want)
	}
	for _, name := range svcs {
		s := f.Services[name]
		require.NotNil(t, s.Healthcheck, "%s has no healthcheck", name)
		hc := s.Healthcheck
		// The image has no shell: the check must be an exec of keel itself.
		require.Equal(t, []string{"CMD", "keel", "healthcheck"}, hc.Test, name)
		interval := composeDuration(t, hc.Interval)
		timeout := composeDuration(t, hc.Timeout)
		require.GreaterOrEqual(t, interval, 5*time.Second, "%s: a check every few seconds is load, not health", name)
		require.LessOrEqual(t, interval, time.Minute, "%s: too slow to notice", name)
		require.Less(t, timeout, interval, name)
		require.Positive(t, hc.Retries, name)
		require.Positive(t, composeDuration(t, hc.StartPeriod), name)

		// Started only once Redis and PostgreSQL answer and the schema is there.
		require.Equal(t, "service_healthy", s.DependsOn["redis"].Condition, name)
		require.Equal(t, "service_healthy", s.DependsOn["postgres"].Condition, name)
		require.Equal(t, "service_completed_successfully", s.DependsOn["migrate"].Condition, name)
		require.Equal(t, "unless-stopped", s.Restart, name)
	}
	for _, dep := range []string{"redis", "postgres"} {
		require.NotNil(t, f.Services[dep].Healthcheck, "%s is waited for as healthy but has no healthcheck", dep)
	}
}

// composeDuration parses Compose's durations (Go's syntax).
func composeDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(s)
	require.NoError(t, err, "duration %q", s)
	return d
}

func TestComposeWebSecretIsRequired(t *testing.T) {
	t.Parallel()
	f := readCompose(t)
	// ${VAR:?message}: Compose refuses to start without it, and no secret
	// ships in the file.
	required := regexp.MustCompile(`^\$\{KEEL_WEB_SECRET:\?[^}]+\}$`)
	require.Regexp(t, required, f.Services["web"].Environment["KEEL_WEB_SECRET"])
	env, err := os.ReadFile(filepath.Join("..", ".env"))
	require.NoError(t, err)
	require.NotRegexp(t, `(?m)^\s*KEEL_WEB_SECRET\s*=`, string(env), ".env must not ship a secret")
}

// prometheusConfig is the part of prometheus.yml keel uses; an unknown key
// is an error, as it is for Prometheus.
type prometheusConfig struct {
	Global struct {
		ScrapeInterval     string `yaml:"scrape_interval"`
		EvaluationInterval string `yaml:"evaluation_interval"`
	} `yaml:"global"`
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string `yaml:"job_name"`
		MetricsPath   string `yaml:"metrics_path"`
		StaticConfigs []struct {
			Targets []string `yaml:"targets"`
		} `yaml:"static_configs"`
		DNSSDConfigs []struct {
			Names           []string `yaml:"names"`
			Type            string   `yaml:"type"`
			Port            int      `yaml:"port"`
			RefreshInterval string   `yaml:"refresh_interval"`
		} `yaml:"dns_sd_configs"`
	} `yaml:"scrape_configs"`
}

func TestComposePrometheusScrapesKeelWithTheShippedRules(t *testing.T) {
	t.Parallel()
	f := readCompose(t)
	prom, ok := f.Services["prometheus"]
	require.True(t, ok, "no prometheus service")
	require.Regexp(t, `^prom/prometheus:v\d+\.\d+\.\d+$`, prom.Image, "a pinned prom/prometheus image")

	// Bind mounts: container path → file in this repository.
	mounts := map[string]string{}
	for _, v := range prom.Volumes {
		parts := strings.Split(v, ":")
		if !strings.HasPrefix(parts[0], "./") {
			continue // a named volume
		}
		require.GreaterOrEqual(t, len(parts), 2, v)
		src := filepath.Join("..", filepath.FromSlash(parts[0]))
		st, err := os.Stat(src)
		require.NoError(t, err, "prometheus mounts %s, which does not exist", parts[0])
		require.False(t, st.IsDir(), parts[0])
		if len(parts) > 2 {
			require.Equal(t, "ro", parts[2], v)
		}
		mounts[parts[1]] = src
	}

	// Prometheus reads /etc/prometheus/prometheus.yml by default.
	cfgPath, ok := mounts["/etc/prometheus/prometheus.yml"]
	require.True(t, ok, "prometheus.yml is not mounted")
	b, err := os.ReadFile(cfgPath)
	require.NoError(t, err)
	var cfg prometheusConfig
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&cfg))
	composeDuration(t, cfg.Global.ScrapeInterval)
	composeDuration(t, cfg.Global.EvaluationInterval)

	// The rules it loads are the file TestAlertRules checks.
	require.NotEmpty(t, cfg.RuleFiles)
	alerts, err := filepath.Abs(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	require.NoError(t, err)
	var loaded []string
	for _, rf := range cfg.RuleFiles {
		require.True(t, path.IsAbs(rf), "rule file %s: relative to the config's directory in the container; name it absolutely", rf)
		src, ok := mounts[rf]
		require.True(t, ok, "rule file %s is not mounted into the container", rf)
		abs, err := filepath.Abs(src)
		require.NoError(t, err)
		loaded = append(loaded, abs)
	}
	require.Contains(t, loaded, alerts, "prometheus does not load deploy/prometheus/alerts.yml")

	// Every target is a service that serves metrics on that port, and every
	// worker and web service is a target.
	scraped := map[string]bool{}
	jobs := map[string]bool{}
	for _, sc := range cfg.ScrapeConfigs {
		require.NotEmpty(t, sc.JobName)
		require.False(t, jobs[sc.JobName], "job %s twice", sc.JobName)
		jobs[sc.JobName] = true
		metricsPath := sc.MetricsPath
		if metricsPath == "" {
			metricsPath = "/metrics"
		}
		var targets []string
		for _, st := range sc.StaticConfigs {
			targets = append(targets, st.Targets...)
		}
		for _, d := range sc.DNSSDConfigs {
			require.Equal(t, "A", d.Type, "%s: the names are Compose services", sc.JobName)
			composeDuration(t, d.RefreshInterval)
			for _, n := range d.Names {
				targets = append(targets, net.JoinHostPort(n, strconv.Itoa(d.Port)))
			}
		}
		require.NotEmpty(t, targets, sc.JobName)
		for _, target := range targets {
			host, port, err := net.SplitHostPort(target)
			require.NoError(t, err, target)
			s, ok := f.Services[host]
			require.True(t, ok, "%s scrapes %s: no such service", sc.JobName, host)
			require.Equal(t, port, metricsPort(t, s, metricsPath), "%s scrapes %s, which serves no metrics on that port", sc.JobName, target)
			scraped[host] = true
		}
	}
	for _, name := range keelServices(f) {
		if sub := f.Services[name].Command[0]; sub == "worker" || sub == "web" {
			require.True(t, scraped[name], "%s serves metrics no one scrapes", name)
		}
	}
}

// metricsPort is the port on which a keel service serves Prometheus
// metrics at metricsPath, or "" when it serves none there: a worker on
// --metrics-addr (or KEEL_METRICS_ADDR) at any path, web on --addr at
// /metrics when anonymous scrapes are allowed.
func metricsPort(t *testing.T, s composeService, metricsPath string) string {
	t.Helper()
	if s.Image != "keel:local" || len(s.Command) == 0 {
		return ""
	}
	flag := func(name string) string {
		for i, a := range s.Command {
			if a == name && i+1 < len(s.Command) {
				return s.Command[i+1]
			}
			if v, ok := strings.CutPrefix(a, name+"="); ok {
				return v
			}
		}
		return ""
	}
	portOf := func(addr string) string {
		if addr == "" {
			return ""
		}
		_, port, err := net.SplitHostPort(addr)
		require.NoError(t, err, addr)
		return port
	}
	switch s.Command[0] {
	case "worker":
		addr := flag("--metrics-addr")
		if addr == "" {
			addr = s.Environment["KEEL_METRICS_ADDR"]
		}
		require.False(t, strings.HasPrefix(addr, "127.0.0.1:") || strings.HasPrefix(addr, "localhost:"),
			"a worker's metrics on %s cannot be reached from another container", addr)
		return portOf(addr)
	case "web":
		if metricsPath != "/metrics" || (s.Environment["KEEL_METRICS_PUBLIC"] != "true" && !slices.Contains(s.Command, "--metrics-public")) {
			return ""
		}
		return portOf(flag("--addr"))
	}
	return ""
}

// image reads the Dockerfile: the binaries the final image holds (built
// with go build -o /out/ from packages of this module, then copied) and its
// entrypoint.
func image(t *testing.T) (bins map[string]bool, entrypoint string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "Dockerfile"))
	require.NoError(t, err)
	built := map[string]bool{}
	bins = map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		fields := strings.Fields(line)
		switch {
		case slices.Contains(fields, "go") && slices.Contains(fields, "build"):
			require.Contains(t, fields, "/out/", "build every binary into /out/")
			for _, f := range fields {
				if !strings.HasPrefix(f, "./") {
					continue
				}
				main, err := os.ReadFile(filepath.Join("..", filepath.FromSlash(f), "main.go"))
				require.NoError(t, err, "the Dockerfile builds %s: no main.go there", f)
				require.Regexp(t, `(?m)^package main$`, string(main), f)
				built[path.Base(f)] = true
			}
		case len(fields) > 0 && fields[0] == "COPY" && slices.Contains(fields, "--from=build"):
			for _, f := range fields {
				if bin, ok := strings.CutPrefix(f, "/out/"); ok {
					require.True(t, built[bin], "the image copies %s, which is not built", bin)
					bins[bin] = true
				}
			}
		case len(fields) > 0 && fields[0] == "ENTRYPOINT":
			var ep []string
			require.NoError(t, json.Unmarshal([]byte(strings.TrimPrefix(line, "ENTRYPOINT")), &ep))
			require.NotEmpty(t, ep)
			entrypoint = ep[0]
		}
	}
	require.NotEmpty(t, bins, "the Dockerfile builds no binary")
	require.True(t, bins[entrypoint], "the image's entrypoint %q is not in it", entrypoint)
	return bins, entrypoint
}

func TestComposeRunsBinariesTheImageHas(t *testing.T) {
	t.Parallel()
	f := readCompose(t)
	bins, entrypoint := image(t)
	n := 0
	for name, s := range f.Services {
		if s.Image != "keel:local" {
			continue
		}
		n++
		bin := entrypoint
		if len(s.Entrypoint) > 0 {
			bin = s.Entrypoint[0]
		}
		require.True(t, bins[bin], "%s runs %s, which the image does not have", name, bin)
		require.NotEmpty(t, s.Command, name)
		if sub := s.Command[0]; sub == "worker" || sub == "api" {
			// The stock binary declares no kinds and has no handlers.
			require.NotEqual(t, "keel", bin, "%s: `keel %s` has no handlers to run; use the program that declares them", name, sub)
		}
		if s.Healthcheck != nil {
			require.True(t, bins[s.Healthcheck.Test[1]], "%s: the healthcheck runs %s, which the image does not have", name, s.Healthcheck.Test[1])
		}
	}
	require.NotZero(t, n)
}
