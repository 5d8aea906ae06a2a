package redisurl

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	"github.com/hibiken/asynq"
)

const (
	// DefaultPort is the port used when a Redis address names none.
	DefaultPort = "6379"
	// DefaultSentinelPort is the port used when a sentinel address names none.
	DefaultSentinelPort = "26379"

	// mask replaces each secret Redact hides.
	mask = "xxxxx"

	example      = "redis://127.0.0.1:6379/0"
	schemeChoice = "redis, rediss, redis-socket, redis-sentinel or redis-cluster"
)

// Parse turns a Redis URL into the matching Asynq connection option:
// asynq.RedisClientOpt for redis, rediss and redis-socket,
// asynq.RedisFailoverClientOpt for redis-sentinel and
// asynq.RedisClusterClientOpt for redis-cluster. The package comment lists
// the forms. Surrounding white space is ignored.
//
// An error names the part of the URL that is wrong and shows the URL with its
// secrets hidden (see Redact).
func Parse(s string) (asynq.RedisConnOpt, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, fmt.Errorf("REDIS_URL is empty (want e.g. %s)", example)
	}
	u, err := split(s)
	if err != nil {
		return nil, fmt.Errorf("REDIS_URL %q: %w", Redact(s), err)
	}
	var opt asynq.RedisConnOpt
	switch u.scheme {
	case "redis", "rediss":
		opt, err = u.client()
	case "redis-socket":
		opt, err = u.socket()
	case "redis-sentinel":
		opt, err = u.sentinel()
	case "redis-cluster":
		opt, err = u.cluster()
	}
	if err != nil {
		return nil, fmt.Errorf("REDIS_URL %q: %w", Redact(s), err)
	}
	return opt, nil
}

// parts is a Redis URL cut into its pieces. The user and password are
// decoded; hosts, path and query are as written.
type parts struct {
	scheme   string
	user     string
	password string
	hosts    string
	path     string
	query    url.Values
}

// split cuts s into its parts. It checks the shape every scheme shares; the
// per-scheme methods check the rest.
func split(s string) (*parts, error) {
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return nil, errors.New("contains a control character")
		}
	}
	i := strings.Index(s, "://")
	if i < 0 {
		return nil, fmt.Errorf("not a URL (want e.g. %s)", example)
	}
	if !validScheme(s[:i]) {
		return nil, fmt.Errorf("malformed scheme (want %s)", schemeChoice)
	}
	u := &parts{scheme: strings.ToLower(s[:i])}
	switch u.scheme {
	case "redis", "rediss", "redis-socket", "redis-sentinel", "redis-cluster":
	default:
		return nil, fmt.Errorf("unsupported scheme %q (want %s)", u.scheme, schemeChoice)
	}
	rest := s[i+len("://"):]
	if strings.Contains(rest, "#") {
		return nil, errors.New(`unexpected "#": percent-encode it as %23 if it is part of the password`)
	}

	authority, after := rest, ""
	if j := strings.IndexAny(rest, "/?"); j >= 0 {
		authority, after = rest[:j], rest[j:]
	}
	if at := strings.IndexByte(after, '@'); authority != "" && !strings.Contains(authority, "@") &&
		at >= 0 && !strings.Contains(after[:at], "=") {
		return nil, errors.New(`the user info seems to contain "/" or "?": percent-encode them as %2F and %3F`)
	}
	u.hosts = authority
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		u.hosts = authority[at+1:]
		user, password, ok := strings.Cut(authority[:at], ":")
		if !ok {
			return nil, fmt.Errorf("user info without a password: write %s://:PASSWORD@HOST for a password alone, or %s://USER:PASSWORD@HOST", u.scheme, u.scheme)
		}
		var err error
		if u.user, err = url.PathUnescape(user); err != nil {
			return nil, errors.New("bad percent-encoding in the user name")
		}
		if u.password, err = url.PathUnescape(password); err != nil {
			return nil, errors.New("bad percent-encoding in the password")
		}
	}

	u.path = after
	rawQuery := ""
	if q := strings.IndexByte(after, '?'); q >= 0 {
		u.path, rawQuery = after[:q], after[q+1:]
	}
	query, err := url.ParseQuery(rawQuery)
	if err != nil {
		// ParseQuery's error may quote a secret value; do not pass it on.
		return nil, errors.New("malformed query string")
	}
	u.query = query
	return u, nil
}

// validScheme reports whether s has the syntax of a URL scheme (RFC 3986).
func validScheme(s string) bool {
	if s == "" {
		return false
	}
	for i, r := range s {
		switch {
		case 'a' <= r && r <= 'z', 'A' <= r && r <= 'Z':
		case i > 0 && ('0' <= r && r <= '9' || r == '+' || r == '-' || r == '.'):
		default:
			return false
		}
	}
	return true
}

// onlyParams fails when the query holds a parameter not in allowed, or one
// parameter twice. It names the parameter, never its value.
func (u *parts) onlyParams(allowed ...string) error {
	for k, vs := range u.query {
		known := false
		for _, a := range allowed {
			known = known || k == a
		}
		switch {
		case !known && len(allowed) == 0:
			return fmt.Errorf("unknown query parameter %q (%s:// takes none)", k, u.scheme)
		case !known:
			return fmt.Errorf("unknown query parameter %q (%s:// takes %s)", k, u.scheme, strings.Join(allowed, ", "))
		case len(vs) > 1:
			return fmt.Errorf("query parameter %q given %d times", k, len(vs))
		}
	}
	return nil
}

// pathDB reads the database number from a path such as "/3". An empty path or
// "/" means database 0.
func (u *parts) pathDB() (int, error) {
	p := strings.TrimPrefix(u.path, "/")
	p = strings.TrimSuffix(p, "/")
	if p == "" {
		return 0, nil
	}
	if strings.Contains(p, "/") {
		return 0, fmt.Errorf("unexpected path %q: only a database number may follow the host, as in /0", u.path)
	}
	return parseDB(p)
}

func parseDB(s string) (int, error) {
	if s == "" {
		return 0, errors.New("empty database number")
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return 0, fmt.Errorf("database %q is not a number", s)
		}
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > 1<<31-1 {
		return 0, fmt.Errorf("database %q is out of range", s)
	}
	return n, nil
}

func (u *parts) client() (asynq.RedisConnOpt, error) {
	if err := u.onlyParams(); err != nil {
		return nil, err
	}
	if u.hosts == "" {
		return nil, fmt.Errorf("missing host (want %s://HOST:PORT/DB)", u.scheme)
	}
	if strings.Contains(u.hosts, ",") {
		return nil, fmt.Errorf("%s:// takes one host; use redis-sentinel:// or redis-cluster:// for several", u.scheme)
	}
	host, addr, err := splitAddr(u.hosts, DefaultPort)
	if err != nil {
		return nil, err
	}
	db, err := u.pathDB()
	if err != nil {
		return nil, err
	}
	opt := asynq.RedisClientOpt{Addr: addr, Username: u.user, Password: u.password, DB: db}
	if u.scheme == "rediss" {
		opt.TLSConfig = &tls.Config{ServerName: host, MinVersion: tls.VersionTLS12}
	}
	return opt, nil
}

func (u *parts) socket() (asynq.RedisConnOpt, error) {
	if err := u.onlyParams("db"); err != nil {
		return nil, err
	}
	if u.hosts != "" {
		return nil, fmt.Errorf("unexpected host %q: the socket path must be absolute, as in redis-socket:///var/run/redis/redis.sock (three slashes)", u.hosts)
	}
	path, err := url.PathUnescape(u.path)
	if err != nil {
		return nil, errors.New("bad percent-encoding in the socket path")
	}
	if path == "" || path == "/" {
		return nil, errors.New("missing socket path (want redis-socket:///path/to/redis.sock)")
	}
	if strings.HasSuffix(path, "/") {
		return nil, fmt.Errorf("socket path %q ends in a slash", path)
	}
	db := 0
	if u.query.Has("db") {
		if db, err = parseDB(u.query.Get("db")); err != nil {
			return nil, err
		}
	}
	return asynq.RedisClientOpt{Network: "unix", Addr: path, Username: u.user, Password: u.password, DB: db}, nil
}

func (u *parts) sentinel() (asynq.RedisConnOpt, error) {
	if err := u.onlyParams("master", "sentinel_username", "sentinel_password"); err != nil {
		return nil, err
	}
	addrs, err := u.addrs(DefaultSentinelPort)
	if err != nil {
		return nil, err
	}
	master := u.query.Get("master")
	if master == "" {
		return nil, errors.New("missing master name (add ?master=NAME, the name the sentinels monitor)")
	}
	db, err := u.pathDB()
	if err != nil {
		return nil, err
	}
	return asynq.RedisFailoverClientOpt{
		MasterName:       master,
		SentinelAddrs:    addrs,
		SentinelUsername: u.query.Get("sentinel_username"),
		SentinelPassword: u.query.Get("sentinel_password"),
		Username:         u.user,
		Password:         u.password,
		DB:               db,
	}, nil
}

func (u *parts) cluster() (asynq.RedisConnOpt, error) {
	if err := u.onlyParams(); err != nil {
		return nil, err
	}
	addrs, err := u.addrs(DefaultPort)
	if err != nil {
		return nil, err
	}
	db, err := u.pathDB()
	if err != nil {
		return nil, err
	}
	if db != 0 {
		return nil, fmt.Errorf("database %d: Redis Cluster has only database 0", db)
	}
	return asynq.RedisClusterClientOpt{Addrs: addrs, Username: u.user, Password: u.password}, nil
}

// addrs reads the comma-separated host list of a multi-host URL.
func (u *parts) addrs(defaultPort string) ([]string, error) {
	if u.hosts == "" {
		return nil, fmt.Errorf("no addresses (want %s://HOST1:PORT,HOST2:PORT,...)", u.scheme)
	}
	list := strings.Split(u.hosts, ",")
	addrs := make([]string, 0, len(list))
	for i, a := range list {
		if a == "" {
			return nil, fmt.Errorf("address %d of %d is empty", i+1, len(list))
		}
		_, addr, err := splitAddr(a, defaultPort)
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, addr)
	}
	return addrs, nil
}

// splitAddr checks one "host[:port]" or "[ipv6][:port]" and returns the host
// and the address with the port filled in.
func splitAddr(a, defaultPort string) (host, addr string, err error) {
	port := defaultPort
	if strings.HasPrefix(a, "[") {
		end := strings.IndexByte(a, ']')
		if end < 0 {
			return "", "", fmt.Errorf("address %q: missing ']'", a)
		}
		host = a[1:end]
		if ip, err := netip.ParseAddr(host); err != nil || !ip.Is6() {
			return "", "", fmt.Errorf("address %q: %q in brackets is not an IPv6 address", a, host)
		}
		switch rest := a[end+1:]; {
		case rest == "":
		case rest[0] == ':':
			port = rest[1:]
		default:
			return "", "", fmt.Errorf("address %q: unexpected %q after ']'", a, rest)
		}
	} else {
		if strings.Count(a, ":") > 1 {
			return "", "", fmt.Errorf("address %q: write an IPv6 address in brackets, as in [::1]:6379", a)
		}
		var hasPort bool
		host, port, hasPort = strings.Cut(a, ":")
		if !hasPort {
			port = defaultPort
		}
		if host == "" {
			return "", "", fmt.Errorf("address %q: missing host name", a)
		}
		for _, r := range host {
			if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || r == '.' || r == '-' || r == '_') {
				return "", "", fmt.Errorf("address %q: invalid character %q in host name", a, r)
			}
		}
	}
	if port == "" {
		return "", "", fmt.Errorf("address %q: empty port", a)
	}
	n := 0
	for _, r := range port {
		if r < '0' || r > '9' || n > 65535 {
			n = -1
			break
		}
		n = n*10 + int(r-'0')
	}
	if n < 1 || n > 65535 {
		return "", "", fmt.Errorf("address %q: bad port %q (want 1-65535)", a, port)
	}
	return host, net.JoinHostPort(host, port), nil
}

// Redact returns s with its secrets replaced by "xxxxx" so that it can be
// logged: the password in the user info (the user name is kept) and the value
// of any query parameter whose name ends in "password". It does not need s to
// be valid, and errs on the side of hiding: user info without a ":" is hidden
// whole, as it may be a password written without its leading colon, and when
// "@" appears more than once everything up to the last one is treated as user
// info. Redact works for any URL with user info, such as a Postgres URL,
// where user info without a ":" is the user name (libpq's reading, which
// pgx's errors show) and is kept.
func Redact(s string) string {
	hide := make([]bool, len(s))
	hideRange := func(from, to int) {
		for i := from; i < to; i++ {
			hide[i] = true
		}
	}

	// User info: everything between "://" and the last "@".
	start, postgres := 0, false
	if i := strings.Index(s, "://"); i >= 0 && validScheme(s[:i]) {
		start = i + len("://")
		postgres = strings.EqualFold(s[:i], "postgres") || strings.EqualFold(s[:i], "postgresql")
	}
	if at := strings.LastIndex(s[start:], "@"); at >= 0 {
		at += start
		info := s[start:at]
		if c := strings.IndexByte(info, ':'); c >= 0 && !strings.ContainsAny(info[:c], "/?&=") {
			hideRange(start+c+1, at)
		} else if !postgres || strings.ContainsAny(info, "/?&=") {
			hideRange(start, at)
		}
	}

	// Query values of parameters named ...password. Only ASCII letters are
	// folded, so that lower and s keep the same byte offsets.
	folded := []byte(s)
	for i, c := range folded {
		if 'A' <= c && c <= 'Z' {
			folded[i] = c + ('a' - 'A')
		}
	}
	lower := string(folded)
	for off := 0; ; {
		k := strings.Index(lower[off:], "password=")
		if k < 0 {
			break
		}
		from := off + k + len("password=")
		to := len(s)
		if amp := strings.IndexByte(s[from:], '&'); amp >= 0 {
			to = from + amp
		}
		hideRange(from, to)
		off = from
	}

	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); i++ {
		if !hide[i] {
			b.WriteByte(s[i])
			continue
		}
		b.WriteString(mask)
		for i+1 < len(s) && hide[i+1] {
			i++
		}
	}
	return b.String()
}
