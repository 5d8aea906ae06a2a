package retry

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgconn"
)

// Rule recognises some errors. It returns ok false for errors it knows
// nothing about, so that the next rule gets a say.
type Rule func(err error) (c Class, ok bool)

// Classifier decides the Class of an error: the outermost mark made with
// Permanent, Transient, After or Wait wins; then the registered rules in
// order; then keel's default rules; anything left is ClassUnknown.
//
// The default rules treat as transient: context.DeadlineExceeded and
// context.Canceled (a worker shutting down), network timeouts, dial errors,
// refused, reset and broken connections, io.ErrUnexpectedEOF, pgconn
// connection errors and timeouts, and Postgres SQLSTATE class 08, 40001,
// 40P01, 53300 and 57P01-57P03. They treat as permanent: Postgres class 22
// and 23, JSON decoding errors (a payload that cannot be decoded never will
// be) and asynq.SkipRetry. An *HTTPError is classified by its status code.
type Classifier struct {
	mu    sync.RWMutex
	rules []Rule
}

// NewClassifier returns a classifier that consults rules, in order, before
// the default rules.
func NewClassifier(rules ...Rule) *Classifier {
	return &Classifier{rules: append([]Rule(nil), rules...)}
}

// Register adds r after the rules already registered and before the default
// rules. It is safe to call while other goroutines classify.
func (c *Classifier) Register(r Rule) {
	c.mu.Lock()
	defer c.mu.Unlock()
	// A fresh slice, so that Classify can range over its copy without the lock.
	c.rules = append(c.rules[:len(c.rules):len(c.rules)], r)
}

// Classify returns the class of err. Classify(nil) returns the empty Class:
// nil is not a failure.
func (c *Classifier) Classify(err error) Class {
	if err == nil {
		return ""
	}
	// The middleware's own wrappers keep the class the handler's error had,
	// so that code further out sees it and not what the wrapper added.
	var s *skipRetry
	if errors.As(err, &s) {
		return s.class
	}
	var d *decided
	if errors.As(err, &d) {
		return d.class
	}
	if e, ok := Marked(err); ok && e.Class != "" {
		return e.Class
	}
	c.mu.RLock()
	rules := c.rules
	c.mu.RUnlock()
	for _, r := range rules {
		if class, ok := r(err); ok {
			return class
		}
	}
	for _, r := range defaultRules {
		if class, ok := r(err); ok {
			return class
		}
	}
	return ClassUnknown
}

// Default is the classifier behind the package-level Classify and Register.
var Default = NewClassifier()

// Classify returns the class of err according to Default.
func Classify(err error) Class { return Default.Classify(err) }

// Register adds r to Default.
func Register(r Rule) { Default.Register(r) }

var defaultRules = []Rule{
	skipRetryRule,
	postgresRule,
	httpRule,
	decodeRule,
	networkRule,
	contextRule,
}

// skipRetryRule honours asynq's own way of saying "do not retry", so handlers
// written for plain asynq keep their meaning.
func skipRetryRule(err error) (Class, bool) {
	if errors.Is(err, asynq.SkipRetry) {
		return ClassPermanent, true
	}
	return "", false
}

// postgresRule runs before the network and context rules: a server's verdict
// is more specific than the transport error it may wrap.
func postgresRule(err error) (Class, bool) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if c, ok := postgresClass(pgErr.Code); ok {
			return c, true
		}
	}
	// Any failure to connect is transient, even a refused password: the job
	// is not at fault, and once an operator fixes the setup it should run.
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) || pgconn.Timeout(err) {
		return ClassTransient, true
	}
	return "", false
}

func postgresClass(code string) (Class, bool) {
	switch code {
	case "40001", // serialization_failure
		"40P01", // deadlock_detected
		"53300", // too_many_connections
		"57P01", // admin_shutdown
		"57P02", // crash_shutdown
		"57P03": // cannot_connect_now
		return ClassTransient, true
	}
	switch {
	case strings.HasPrefix(code, "08"): // connection exception
		return ClassTransient, true
	case strings.HasPrefix(code, "22"), // data exception
		strings.HasPrefix(code, "23"), // integrity constraint violation
		code == "KC001":               // keel: a keyed job admitted outside READ COMMITTED (migration 0032)
		return ClassPermanent, true
	}
	return "", false
}

func httpRule(err error) (Class, bool) {
	var h *HTTPError
	if errors.As(err, &h) {
		return statusClass(h.StatusCode), true
	}
	return "", false
}

func decodeRule(err error) (Class, bool) {
	var syntaxErr *json.SyntaxError
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &syntaxErr) || errors.As(err, &typeErr) {
		return ClassPermanent, true
	}
	return "", false
}

func networkRule(err error) (Class, bool) {
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return ClassTransient, true
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return ClassTransient, true
	}
	for _, target := range []error{
		syscall.ECONNREFUSED,
		syscall.ECONNRESET,
		syscall.ECONNABORTED,
		syscall.EPIPE,
		syscall.ENETUNREACH,
		syscall.EHOSTUNREACH,
		io.ErrUnexpectedEOF,
	} {
		if errors.Is(err, target) {
			return ClassTransient, true
		}
	}
	return "", false
}

// contextRule treats Canceled as transient because in a worker it almost
// always means shutdown: the task goes back to the queue and should run again.
func contextRule(err error) (Class, bool) {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return ClassTransient, true
	}
	return "", false
}
