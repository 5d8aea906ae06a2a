package retry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

func TestClassify(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name string
		err  error
		want Class
		// rule is the default rule that must recognise err on its own; nil
		// for marks and the fallback.
		rule Rule
	}{
		{name: "nil", err: nil, want: ""},
		{name: "unrecognised", err: errors.New("boom"), want: ClassUnknown},

		{name: "marked permanent", err: Permanent(errors.New("card declined")), want: ClassPermanent},
		{name: "marked transient", err: Transient(errors.New("busy")), want: ClassTransient},
		{name: "marked after", err: After(time.Minute, errors.New("slow down")), want: ClassTransient},
		{name: "marked wait", err: Wait(0, errors.New("no slot")), want: ClassWait},
		{name: "mark beats rules", err: Transient(decodeErr(t)), want: ClassTransient},
		{name: "mark found through wrapping", err: fmt.Errorf("charge: %w", Permanent(io.ErrUnexpectedEOF)), want: ClassPermanent},
		{name: "outermost mark wins", err: Transient(Permanent(errors.New("x"))), want: ClassTransient},

		{name: "context deadline", err: deadlineErr(t), want: ClassTransient, rule: contextRule},
		{name: "context canceled", err: canceledErr(t), want: ClassTransient, rule: contextRule},
		{name: "net timeout", err: netTimeoutErr(t), want: ClassTransient, rule: networkRule},
		{name: "dial error", err: dialErr(t), want: ClassTransient, rule: networkRule},
		{name: "connection refused", err: refusedErr(t), want: ClassTransient, rule: networkRule},
		{name: "connection reset", err: resetErr(t), want: ClassTransient, rule: networkRule},
		{name: "broken pipe", err: brokenPipeErr(t), want: ClassTransient, rule: networkRule},
		{name: "unexpected EOF", err: unexpectedEOFErr(t), want: ClassTransient, rule: networkRule},

		{name: "postgres 08006 connection failure", err: pgErr("08006"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 40001 serialization", err: pgErr("40001"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 40P01 deadlock", err: pgErr("40P01"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 53300 too many connections", err: pgErr("53300"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 57P01 admin shutdown", err: pgErr("57P01"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 57P03 cannot connect now", err: pgErr("57P03"), want: ClassTransient, rule: postgresRule},
		{name: "postgres 22P02 invalid text", err: pgErr("22P02"), want: ClassPermanent, rule: postgresRule},
		{name: "postgres 23505 unique violation", err: pgErr("23505"), want: ClassPermanent, rule: postgresRule},
		{name: "keel KC001 keyed job outside READ COMMITTED", err: pgErr("KC001"), want: ClassPermanent, rule: postgresRule},
		{name: "postgres 42P01 undefined table", err: pgErr("42P01"), want: ClassUnknown},
		{name: "pgconn connect error", err: pgConnectErr(t), want: ClassTransient, rule: postgresRule},
		{name: "pgconn timeout", err: pgTimeoutErr(t), want: ClassTransient, rule: postgresRule},

		{name: "http 503", err: &HTTPError{StatusCode: 503}, want: ClassTransient, rule: httpRule},
		{name: "http 404", err: fmt.Errorf("fetch: %w", &HTTPError{StatusCode: 404}), want: ClassPermanent, rule: httpRule},

		{name: "json syntax", err: decodeErr(t), want: ClassPermanent, rule: decodeRule},
		{name: "json type", err: typeErr(t), want: ClassPermanent, rule: decodeRule},
		{name: "asynq skip retry", err: fmt.Errorf("bad task: %w", asynq.SkipRetry), want: ClassPermanent, rule: skipRetryRule},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tt.want, NewClassifier().Classify(tt.err))
			if tt.rule != nil {
				got, ok := tt.rule(tt.err)
				require.True(t, ok, "rule does not recognise %v", tt.err)
				require.Equal(t, tt.want, got)
			}
		})
	}
}

func TestClassifierUserRules(t *testing.T) {
	t.Parallel()

	errQuota := errors.New("quota exhausted")
	quota := func(err error) (Class, bool) {
		if errors.Is(err, errQuota) {
			return ClassWait, true
		}
		return "", false
	}
	refusedIsPermanent := func(err error) (Class, bool) {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return ClassPermanent, true
		}
		return "", false
	}
	never := func(error) (Class, bool) { return ClassTransient, false }

	c := NewClassifier(never, quota)
	require.Equal(t, ClassWait, c.Classify(fmt.Errorf("send: %w", errQuota)))
	require.Equal(t, ClassTransient, c.Classify(refusedErr(t)), "default applies before Register")

	c.Register(refusedIsPermanent)
	require.Equal(t, ClassPermanent, c.Classify(refusedErr(t)), "a registered rule wins over the defaults")
	require.Equal(t, ClassTransient, c.Classify(Transient(refusedErr(t))), "a mark wins over every rule")

	first := func(err error) (Class, bool) { return ClassUnknown, errors.Is(err, errQuota) }
	c.Register(first)
	require.Equal(t, ClassWait, c.Classify(errQuota), "earlier rules win over later ones")
}

func TestClassifierRegisterConcurrent(t *testing.T) {
	t.Parallel()

	c := NewClassifier()
	got := make([]Class, 8)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() {
			target := fmt.Errorf("err %d", i)
			c.Register(func(err error) (Class, bool) { return ClassPermanent, errors.Is(err, target) })
			for range 100 {
				_ = c.Classify(target)
			}
			got[i] = c.Classify(target)
		})
	}
	wg.Wait()
	for i, class := range got {
		require.Equal(t, ClassPermanent, class, "rule %d", i)
	}
}

func TestPackageClassifier(t *testing.T) {
	// Not parallel: it changes Default for everyone.
	errLegacy := errors.New("legacy system says no")
	require.Equal(t, ClassUnknown, Classify(errLegacy))
	Register(func(err error) (Class, bool) { return ClassPermanent, errors.Is(err, errLegacy) })
	require.Equal(t, ClassPermanent, Classify(errLegacy))
}

func pgErr(code string) error {
	return fmt.Errorf("insert order: %w", &pgconn.PgError{Severity: "ERROR", Code: code, Message: "test"})
}

func deadlineErr(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	return fmt.Errorf("query: %w", ctx.Err())
}

func canceledErr(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	return ctx.Err()
}

// listen returns a loopback listener that is closed when the test ends.
func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	return ln
}

func netTimeoutErr(t *testing.T) error {
	t.Helper()
	ln := listen(t)
	conn, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetReadDeadline(time.Now()))
	_, err = conn.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	return err
}

func dialErr(t *testing.T) error {
	t.Helper()
	_, err := net.Dial("unix", filepath.Join(t.TempDir(), "missing.sock"))
	var opErr *net.OpError
	require.ErrorAs(t, err, &opErr)
	require.Equal(t, "dial", opErr.Op)
	return err
}

func refusedErr(t *testing.T) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	_, err = net.Dial("tcp", addr)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	return err
}

func resetErr(t *testing.T) error {
	t.Helper()
	ln := listen(t)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		// Wait for the client's byte, so that its dial has finished, then
		// close with linger 0, which sends RST instead of FIN.
		_, _ = conn.Read(make([]byte, 1))
		_ = conn.(*net.TCPConn).SetLinger(0)
		conn.Close()
	}()
	conn, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.Write([]byte("x"))
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = conn.Read(make([]byte, 1))
	require.ErrorIs(t, err, syscall.ECONNRESET)
	return err
}

func brokenPipeErr(t *testing.T) error {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer w.Close()
	require.NoError(t, r.Close())
	_, err = w.Write([]byte("x"))
	require.ErrorIs(t, err, syscall.EPIPE)
	return err
}

func unexpectedEOFErr(t *testing.T) error {
	t.Helper()
	_, err := io.ReadFull(strings.NewReader("ab"), make([]byte, 4))
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	return fmt.Errorf("read frame: %w", err)
}

// pgConnectErr connects pgconn to a server that does not speak Postgres, so
// that the connect error wraps nothing another rule knows.
func pgConnectErr(t *testing.T) error {
	t.Helper()
	ln := listen(t)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = conn.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\n"))
			conn.Close()
		}
	}()
	_, err := pgconn.Connect(t.Context(), "postgres://keel@"+ln.Addr().String()+"/keel?sslmode=disable")
	var connErr *pgconn.ConnectError
	require.ErrorAs(t, err, &connErr)
	require.False(t, pgconn.Timeout(err))
	return err
}

// pgTimeoutErr connects pgconn to a server that never answers.
func pgTimeoutErr(t *testing.T) error {
	t.Helper()
	ln := listen(t)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				// Hold the connection until the client gives up on it.
				_, _ = io.Copy(io.Discard, conn)
				conn.Close()
			}()
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err := pgconn.Connect(ctx, "postgres://keel@"+ln.Addr().String()+"/keel?sslmode=disable")
	require.True(t, pgconn.Timeout(err), "got %v", err)
	return err
}

func decodeErr(t *testing.T) error {
	t.Helper()
	var v map[string]any
	err := json.Unmarshal([]byte(`{"order":`), &v)
	var syntaxErr *json.SyntaxError
	require.ErrorAs(t, err, &syntaxErr)
	return fmt.Errorf("decode payload: %w", err)
}

func typeErr(t *testing.T) error {
	t.Helper()
	var v struct{ Amount int }
	err := json.Unmarshal([]byte(`{"Amount":"ten"}`), &v)
	var typeErr *json.UnmarshalTypeError
	require.ErrorAs(t, err, &typeErr)
	return err
}
