package cli

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/bcrypt"

	"github.com/keeljobs/keel/redisurl"
	"github.com/keeljobs/keel/web"
)

// webFlags are the web server's own settings.
type webFlags struct {
	addr          string
	metricsToken  string
	metricsPublic bool
	proxyHeader   string
	behindHTTPS   bool
	origin        string
	tlsCert       string
	tlsKey        string
	sessionTTL    time.Duration
	proxies       []string
	hosts         []string
	logins        int
}

func webCmd(e *Env) *cobra.Command {
	f := &webFlags{}
	cmd := &cobra.Command{
		Use:   "web",
		Short: "Serve the dashboard: dead letters, job look-up, actions, asynqmon and /metrics",
		Long: `Serve keel's dashboard on one address: the overview, dead letters, look-up by
business key, replay/discard/resolve actions, asynqmon under /monitoring/,
/metrics for Prometheus and /healthz.

Everything but /healthz needs a signed-in user. Users come from KEEL_WEB_USERS,
comma-separated name:role:bcrypt-hash entries (role viewer or operator; make a
hash with "keel web hash-password"). KEEL_WEB_SECRET (32+ bytes) signs sessions;
set it when running more than one web server. Behind a single sign-on proxy,
--trust-proxy-header X-Forwarded-User takes the user name from the proxy, and
KEEL_WEB_PROXY_OPERATORS lists who among them are operators.`,
		Example: "  read -rs PW && printf '%s' \"$PW\" | keel web hash-password    # prints $2a$12$…\n" +
			"  KEEL_WEB_USERS='ana:operator:$2a$12$…' KEEL_WEB_SECRET=$(openssl rand -hex 32) keel web --addr 0.0.0.0:8080",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var notice bytes.Buffer
			cfg, err := f.config(&notice)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			log := e.Logger()
			redis, err := e.RedisOpt()
			if err != nil {
				return err
			}
			// Dead letters, job pages and look-ups read the ledger: in a
			// Redis outage, a dashboard (re)started then still shows them.
			if err := pingRedis(ctx, redis, redisurl.Redact(e.redisURL)); redisRefused(err) {
				return err // a mistake in the settings, not an outage
			} else if err != nil {
				log.Warn("keel web: starting without Redis; the ledger's pages work, asynqmon, replays and cancels wait for it", "err", err)
			}
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			cfg.Redis, cfg.Pool, cfg.Logger, cfg.Kinds = redis, pool, log, e.app.Kinds
			srv, err := web.New(cfg)
			if err != nil {
				if errors.Is(err, web.ErrNoCredentials) {
					return usageError{err}
				}
				return err
			}
			ln, err := net.Listen("tcp", cfg.Addr)
			if err != nil {
				srv.Close()
				return fmt.Errorf("keel web: %w", err)
			}
			// The one-time password, once the server listens.
			_, _ = notice.WriteTo(cmd.ErrOrStderr())
			if len(cfg.Secret) == 0 {
				log.Warn("keel web: KEEL_WEB_SECRET is not set; sessions end when this server restarts and are not valid on other replicas")
			}
			return srv.Serve(ctx, ln)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.addr, "addr", envOr("KEEL_WEB_ADDR", web.DefaultAddr), "listen address (env KEEL_WEB_ADDR)")
	fl.StringVar(&f.metricsToken, "metrics-token", os.Getenv("KEEL_METRICS_TOKEN"),
		"bearer token Prometheus sends to read /metrics (env KEEL_METRICS_TOKEN)")
	hideDefault(cmd, "metrics-token", "KEEL_METRICS_TOKEN")
	fl.BoolVar(&f.metricsPublic, "metrics-public", envBool(cmd, "KEEL_METRICS_PUBLIC"),
		"serve /metrics without authentication (env KEEL_METRICS_PUBLIC)")
	fl.StringVar(&f.proxyHeader, "trust-proxy-header", os.Getenv("KEEL_WEB_PROXY_HEADER"),
		"trust this header (e.g. X-Forwarded-User) to name a user authenticated by an SSO proxy; only when nothing but the proxy can reach this server (env KEEL_WEB_PROXY_HEADER)")
	fl.BoolVar(&f.behindHTTPS, "behind-https", envBool(cmd, "KEEL_WEB_BEHIND_HTTPS"),
		"a proxy in front terminates HTTPS: mark cookies Secure (env KEEL_WEB_BEHIND_HTTPS)")
	fl.StringVar(&f.origin, "origin", os.Getenv("KEEL_WEB_ORIGIN"),
		"public origin, e.g. https://jobs.example.com, when a proxy rewrites the Host header (env KEEL_WEB_ORIGIN)")
	fl.StringVar(&f.tlsCert, "tls-cert", os.Getenv("KEEL_WEB_TLS_CERT"), "serve HTTPS with this certificate file (env KEEL_WEB_TLS_CERT)")
	fl.StringVar(&f.tlsKey, "tls-key", os.Getenv("KEEL_WEB_TLS_KEY"), "the certificate's key file (env KEEL_WEB_TLS_KEY)")
	fl.DurationVar(&f.sessionTTL, "session-ttl", envDuration("KEEL_WEB_SESSION_TTL", web.DefaultSessionTTL),
		"how long a sign-in lasts (env KEEL_WEB_SESSION_TTL)")
	fl.StringSliceVar(&f.proxies, "trusted-proxy", splitList(os.Getenv("KEEL_WEB_TRUSTED_PROXIES")),
		"address or CIDR prefix of a reverse proxy whose X-Forwarded-For is read, repeatable; none by default (env KEEL_WEB_TRUSTED_PROXIES, comma-separated)")
	fl.StringSliceVar(&f.hosts, "allowed-host", splitList(os.Getenv("KEEL_WEB_ALLOWED_HOSTS")),
		"a further host name the server answers to, repeatable (env KEEL_WEB_ALLOWED_HOSTS, comma-separated)")
	fl.IntVar(&f.logins, "login-concurrency", envInt("KEEL_WEB_LOGIN_CONCURRENCY", web.DefaultLoginConcurrency),
		"password comparisons at once; sign-ins from browsers and addresses not known for the account may hold half of them, and get 503 beyond (env KEEL_WEB_LOGIN_CONCURRENCY)")
	cmd.AddCommand(hashPasswordCmd())
	return cmd
}

func (f *webFlags) config(stderr io.Writer) (web.Config, error) {
	if web.CheckAddr(f.addr) != nil {
		return web.Config{}, usageError{fmt.Errorf("--addr / KEEL_WEB_ADDR %q: want host:port, like 127.0.0.1:8080", f.addr)}
	}
	users, err := web.ParseUsers(os.Getenv("KEEL_WEB_USERS"))
	if err != nil {
		return web.Config{}, usageError{err}
	}
	if f.sessionTTL <= 0 {
		return web.Config{}, usageError{fmt.Errorf("--session-ttl / KEEL_WEB_SESSION_TTL must be a positive duration like 12h")}
	}
	cfg := web.Config{
		Addr: f.addr, Users: users, Secret: []byte(os.Getenv("KEEL_WEB_SECRET")), SessionTTL: f.sessionTTL,
		BehindHTTPS: f.behindHTTPS, TLSCertFile: f.tlsCert, TLSKeyFile: f.tlsKey, Origin: f.origin,
		ProxyUserHeader: f.proxyHeader, ProxyOperators: splitList(os.Getenv("KEEL_WEB_PROXY_OPERATORS")),
		TrustedProxies: f.proxies, AllowedHosts: f.hosts, LoginConcurrency: f.logins,
		MetricsToken: f.metricsToken, MetricsPublic: f.metricsPublic,
	}
	// On this machine only, with nobody configured, make a one-time
	// operator so that trying keel out needs no setup; anywhere else
	// web.New refuses to start.
	if len(users) == 0 && f.proxyHeader == "" && web.IsLoopback(f.addr) {
		u, password, err := oneTimeUser()
		if err != nil {
			return web.Config{}, err
		}
		cfg.Users = []web.User{u}
		fmt.Fprintf(stderr, "keel web: no KEEL_WEB_USERS set; sign in at http://%s as %q with password %s (valid until this server stops)\n",
			f.addr, u.Name, password)
	}
	if len(cfg.Users) == 0 && cfg.ProxyUserHeader == "" && !web.IsLoopback(f.addr) {
		return web.Config{}, usageError{fmt.Errorf("%w (address %s)", web.ErrNoCredentials, f.addr)}
	}
	// Every setting is checked before anything is connected to; the
	// connections are only stand-ins here.
	probe := cfg
	probe.Redis, probe.Pool = asynq.RedisClientOpt{}, new(pgxpool.Pool)
	if err := probe.Validate(); err != nil {
		return web.Config{}, usageError{err}
	}
	return cfg, nil
}

func oneTimeUser() (web.User, string, error) {
	var b [15]byte
	if _, err := rand.Read(b[:]); err != nil {
		return web.User{}, "", err
	}
	password := base64.RawURLEncoding.EncodeToString(b[:])
	// The lowest cost: this password is random and lives as long as the process.
	hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	if err != nil {
		return web.User{}, "", err
	}
	return web.User{Name: "admin", Role: web.RoleOperator, PasswordHash: hash}, password, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// hashPassword is web.HashPassword. Tests swap in a cheaper hash: under
// the race detector one at web.PasswordCost takes seconds.
var hashPassword = web.HashPassword

func hashPasswordCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "hash-password",
		Short: "Read a password from stdin (first line) and print its bcrypt hash for KEEL_WEB_USERS",
		Example: "  read -rs PW && printf '%s' \"$PW\" | keel web hash-password\n" +
			"  KEEL_WEB_USERS='ana:operator:<hash>,ben:viewer:<hash>'   # single quotes: hashes contain $",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			line, err := bufio.NewReader(io.LimitReader(cmd.InOrStdin(), 4096)).ReadString('\n')
			if err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			password := strings.TrimRight(line, "\r\n")
			hash, err := hashPassword([]byte(password))
			if err != nil {
				return usageError{err}
			}
			fmt.Fprintln(cmd.OutOrStdout(), hash)
			return nil
		},
	}
}
