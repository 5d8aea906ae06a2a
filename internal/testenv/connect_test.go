package testenv

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		defer c.Close(ctx)
	}

	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = connectConfig(short, cfg, nil)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "53300" {
		t.Fatalf("with no slot and a context that ended: %v, want the server's 53300", err)
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
