package testenv

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestAHelperWaitsForAConnectionSlot: with every connection slot of the
// server taken, a helper's connection waits for one to free rather than
// failing the test; it gives up with the server's refusal when its context
// ends first.
func TestAHelperWaitsForAConnectionSlot(t *testing.T) {
	pg := StartPostgres(t, "max_connections=2", "superuser_reserved_connections=0")
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(pg.URL(""))
	if err != nil {
		t.Fatal(err)
	}
	var held []*pgx.Conn
	for range 2 {
		// A connection of the server's own start-up check may still be
		// closing: wait for its slot as the helper does.
		hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		c, err := connectConfig(hctx, cfg, nil)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		defer c.Close(ctx)
	}

	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	refusals := 0
	_, err = connectConfig(short, cfg, func() { refusals++ })
	require.Error(t, err, "connected with no slot free")
	require.Positive(t, refusals, "never refused: %v", err)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		require.Equal(t, "53300", pgErr.Code)
	} else {
		require.ErrorIs(t, err, context.DeadlineExceeded, "gave up on something else")
	}

	refused := make(chan struct{}, 1)
	got := make(chan error, 1)
	go func() {
		long, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		c, err := connectConfig(long, cfg, func() {
			select {
			case refused <- struct{}{}:
			default:
			}
		})
		if err == nil {
			err = c.Close(ctx)
		}
		got <- err
	}()
	<-refused
	if err := held[0].Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("a slot freed while the helper waited: %v", err)
	}
}
