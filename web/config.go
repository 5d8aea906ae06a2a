package web

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/tasks"
)

// Defaults of Config.
const (
	DefaultAddr           = "127.0.0.1:8080"
	DefaultSessionTTL     = 12 * time.Hour
	DefaultSampleInterval = 10 * time.Second
	DefaultPageSize       = 50
	// SamplePoints is how many samples of each queue the server keeps: an
	// hour at the default interval.
	SamplePoints = 360
	// MonitoringPath is where asynqmon is mounted.
	MonitoringPath = "/monitoring"
	// MinSecretBytes is the shortest session secret accepted.
	MinSecretBytes = 32
	// DefaultLoginConcurrency is how many password comparisons run at once.
	DefaultLoginConcurrency = 4
	// MaxNoteChars is the longest note an operator action takes.
	MaxNoteChars = 2000
)

// ErrNoCredentials means the server would listen beyond this machine with
// nobody able to sign in: it refuses rather than serve an open dashboard.
var ErrNoCredentials = errors.New("keel web: refusing to listen on a non-loopback address with no credentials " +
	"configured: set KEEL_WEB_USERS (see `keel web hash-password`) or --trust-proxy-header, " +
	"or listen on 127.0.0.1")

// Config configures a Server.
type Config struct {
	// Addr is where Run listens. Default DefaultAddr (loopback only). A
	// non-loopback address needs Users or ProxyUserHeader.
	Addr string
	// Redis holds asynq's queues. Required.
	Redis asynq.RedisConnOpt
	// Pool holds the ledger. Required.
	Pool *pgxpool.Pool
	// Users may sign in with a password (see ParseUsers, HashPassword).
	Users []User
	// Secret signs session cookies and form tokens; at least MinSecretBytes.
	// Default: random at start, so sessions end when the server restarts and
	// are not valid on other replicas — set it when running several.
	Secret []byte
	// SessionTTL is how long a sign-in lasts. Default 12h.
	SessionTTL time.Duration
	// BehindHTTPS says a proxy terminates TLS in front of the server: cookies
	// are marked Secure and the origin is https. Implied by TLSCertFile.
	BehindHTTPS bool
	// TLSCertFile and TLSKeyFile make Run serve HTTPS itself.
	TLSCertFile, TLSKeyFile string
	// Origin is the public origin (https://jobs.example.com) state-changing
	// requests must come from. Default: the scheme and Host of each request;
	// set it when a proxy rewrites the Host header.
	Origin string
	// ProxyUserHeader, when set, trusts that header (X-Forwarded-User, say)
	// to name a user already authenticated by an SSO proxy in front. Only
	// enable it when the server cannot be reached except through that proxy
	// and the proxy overwrites the header on every request.
	ProxyUserHeader string
	// ProxyOperators are the proxy-authenticated users who get the operator
	// role; everyone else the proxy lets through is a viewer.
	ProxyOperators []string
	// MetricsToken, when set, lets Prometheus read /metrics with
	// "Authorization: Bearer <token>". Signed-in users can always read it.
	MetricsToken string
	// MetricsPublic serves /metrics to anyone. Default false.
	MetricsPublic bool
	// Registry is where the server registers its collectors and what
	// /metrics serves. Default: a new registry with Go and process metrics.
	Registry *prometheus.Registry
	// Kinds are the program's kinds: the dashboard shows their payloads
	// through their Summary. Default none: every payload is hidden.
	Kinds *tasks.Kinds
	// PayloadFormatter turns a payload into the text people see, here and
	// in asynqmon; it is where secrets are redacted. Default
	// DeclaredPayloads(Kinds): the kind's Summary for kinds of Kinds, and
	// nothing for other kinds, whose redaction the dashboard cannot apply
	// (operators may show such a payload on the job's page, audited).
	PayloadFormatter func(kind string, payload []byte) string
	// SampleInterval is how often queue counters are sampled for the
	// last-hour charts (SamplePoints samples are kept). Default 10s.
	SampleInterval time.Duration
	// ScrapeTimeout bounds one read of Redis and the ledger for /metrics.
	// Default metrics.DefaultScrapeTimeout.
	ScrapeTimeout time.Duration
	// PageSize is how many dead letters a page lists. Default 50.
	PageSize int
	// TrustedProxies are the addresses (10.0.0.7) and prefixes (10.0.0.0/8)
	// of reverse proxies in front of the server. Only a connection from one
	// of them has its X-Forwarded-For read, to count sign-in attempts per
	// real client rather than per proxy. Default none: the header is ignored.
	TrustedProxies []string
	// AllowedHosts are further host names the server answers to. It always
	// answers to its listen host, localhost, 127.0.0.1, [::1] and Origin's
	// host (and, listening on all interfaces, to any IP address); any other
	// Host header is refused, so a DNS-rebinding page cannot reach it.
	AllowedHosts []string
	// LoginConcurrency caps concurrent password comparisons (bcrypt is
	// slow by design). Sign-ins from browsers and addresses not known for
	// the account may hold only half of them (all when it is 1) and get 503
	// beyond that; known ones wait briefly for a slot. Default
	// DefaultLoginConcurrency.
	LoginConcurrency int
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// DeclaredPayloads is the default PayloadFormatter: the kind's Summary
// (Kinds.Summarize) for a kind of kinds, and a note that the payload is
// hidden for any other: a kind's Summary, which redacts, runs only in a
// program that declares the kind, so the stock keel binary, which declares
// none, would otherwise show every payload whole.
func DeclaredPayloads(kinds *tasks.Kinds) func(kind string, payload []byte) string {
	return func(kind string, payload []byte) string {
		if !kinds.Known(kind) {
			return hiddenPayload(kind)
		}
		return kinds.Summarize(kind, payload)
	}
}

func hiddenPayload(kind string) string {
	return "(payload hidden: this dashboard's program does not declare kind \"" + visible.Text(kind) + "\", so it cannot apply the kind's redaction; " +
		"run the dashboard from your own binary (cli.Main) to see it through the kind's Summary, or, as an operator, show it on the job's page)"
}

// WithDefaults returns c with every unset field at its default. It does not
// invent a secret; New does.
func (c Config) WithDefaults() Config {
	if c.Addr == "" {
		c.Addr = DefaultAddr
	}
	if c.SessionTTL <= 0 {
		c.SessionTTL = DefaultSessionTTL
	}
	if c.SampleInterval <= 0 {
		c.SampleInterval = DefaultSampleInterval
	}
	if c.ScrapeTimeout <= 0 {
		c.ScrapeTimeout = metrics.DefaultScrapeTimeout
	}
	if c.PageSize <= 0 {
		c.PageSize = DefaultPageSize
	}
	if c.LoginConcurrency <= 0 {
		c.LoginConcurrency = DefaultLoginConcurrency
	}
	if c.PayloadFormatter == nil {
		c.PayloadFormatter = DeclaredPayloads(c.Kinds)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TLSCertFile != "" {
		c.BehindHTTPS = true
	}
	c.ProxyUserHeader = strings.TrimSpace(c.ProxyUserHeader)
	return c
}

// Validate reports the first thing wrong with c.
func (c Config) Validate() error {
	switch {
	case c.Redis == nil:
		return errors.New("keel web: Config.Redis is required")
	case c.Pool == nil:
		return errors.New("keel web: Config.Pool is required")
	case len(c.Secret) > 0 && len(c.Secret) < MinSecretBytes:
		return fmt.Errorf("keel web: the session secret (KEEL_WEB_SECRET) is %d bytes; use at least %d random bytes", len(c.Secret), MinSecretBytes)
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return errors.New("keel web: give both a TLS certificate and a key, or neither")
	case len(c.ProxyOperators) > 0 && c.ProxyUserHeader == "":
		return errors.New("keel web: proxy operators (KEEL_WEB_PROXY_OPERATORS) are set but --trust-proxy-header is not")
	}
	if h := c.ProxyUserHeader; h != "" && (strings.ContainsAny(h, " :\t\r\n") || strings.EqualFold(h, "Cookie") || strings.EqualFold(h, "Authorization")) {
		return fmt.Errorf("keel web: %q cannot be the trusted proxy user header", h)
	}
	if c.Origin != "" {
		if _, err := parseOrigin(c.Origin); err != nil {
			return err
		}
	}
	if _, err := parseTrustedProxies(c.TrustedProxies); err != nil {
		return err
	}
	for _, h := range c.AllowedHosts {
		if err := validAllowedHost(h); err != nil {
			return err
		}
	}
	seen := map[string]bool{}
	for _, u := range c.Users {
		if err := u.validate(); err != nil {
			return err
		}
		if seen[u.Name] {
			return fmt.Errorf("keel web: user %q is listed twice", u.Name)
		}
		seen[u.Name] = true
	}
	if err := CheckAddr(c.Addr); err != nil {
		return err
	}
	if len(c.Users) == 0 && c.ProxyUserHeader == "" && !IsLoopback(c.Addr) {
		return fmt.Errorf("%w (address %s)", ErrNoCredentials, c.Addr)
	}
	return nil
}

// CheckAddr refuses a listen address that is not host:port with a port
// number (0: any free port), instead of its failing later as something
// else (not loopback, say).
func CheckAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if n, perr := strconv.Atoi(port); err != nil || perr != nil || n < 0 || n > 65535 {
		return fmt.Errorf("keel web: address %q: want host:port, like %s", addr, DefaultAddr)
	}
	return nil
}

// IsLoopback reports whether addr (host:port) listens on this machine only.
// An empty host (all interfaces) and names other than localhost count as
// reachable from outside.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// parseOrigin normalises an origin (scheme://host[:port]).
func parseOrigin(s string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(s))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" ||
		(u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil {
		return "", fmt.Errorf("keel web: origin %q: want scheme://host[:port], e.g. https://jobs.example.com", s)
	}
	return u.Scheme + "://" + strings.ToLower(u.Host), nil
}
