package handlers

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/tasks"
)

// API is the example order service: the HTTP handlers users write, which
// create business rows and enqueue their jobs in the same transaction.
type API struct {
	Pool   *pgxpool.Pool
	Client *tasks.Client
}

// Handler routes POST /orders and GET /orders/{id}.
func (a *API) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", a.createOrder)
	mux.HandleFunc("GET /orders/{id}", a.getOrder)
	return mux
}

// OrderRequest is the body of POST /orders.
type OrderRequest struct {
	Email  string `json:"email"`
	Amount int64  `json:"amount"`
}

// JobState is one job of an order as GET /orders/{id} shows it.
type JobState struct {
	Kind      string `json:"kind"`
	JobID     string `json:"job_id,omitempty"`
	Status    string `json:"status"`
	Attempts  int    `json:"attempts"`
	LastError string `json:"last_error,omitempty"`
}

// OrderResponse is what the API answers.
type OrderResponse struct {
	ID        string     `json:"id"`
	Email     string     `json:"email"`
	Amount    int64      `json:"amount"`
	CreatedAt time.Time  `json:"created_at"`
	Duplicate bool       `json:"duplicate,omitempty"`
	Jobs      []JobState `json:"jobs,omitempty"`
}

// errKeyReused: an Idempotency-Key sent again with another order.
var errKeyReused = errors.New("this Idempotency-Key was used for another order (email or amount differ)")

// orderID derives the order id from the client's Idempotency-Key, so a
// retried POST (a double click, a client timeout) is the same order.
func orderID(key string) string {
	sum := sha256.Sum256([]byte(key))
	return "ord_" + hex.EncodeToString(sum[:8])
}

func (a *API) createOrder(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		httpError(w, http.StatusBadRequest, "an Idempotency-Key header is required")
		return
	}
	var req OrderRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		httpError(w, http.StatusBadRequest, "body: "+err.Error())
		return
	}
	if !strings.Contains(req.Email, "@") || req.Amount <= 0 {
		httpError(w, http.StatusUnprocessableEntity, "email must be an address and amount positive")
		return
	}
	ctx := r.Context()
	resp := OrderResponse{ID: orderID(key), Email: req.Email, Amount: req.Amount}
	err := pgx.BeginFunc(ctx, a.Pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO keel_example_orders (id, email, amount) VALUES ($1, $2, $3)
			ON CONFLICT (id) DO NOTHING`, resp.ID, req.Email, req.Amount)
		if err != nil {
			return err
		}
		resp.Duplicate = tag.RowsAffected() == 0
		if resp.Duplicate {
			// A retry carries the same order; another under the same key
			// is the client's mistake, not a second order to confirm.
			var same bool
			if err := tx.QueryRow(ctx, `SELECT email = $2 AND amount = $3 FROM keel_example_orders WHERE id = $1`,
				resp.ID, req.Email, req.Amount).Scan(&same); err != nil {
				return err
			}
			if !same {
				return errKeyReused
			}
		}
		// The jobs commit with the order or not at all; the ledger dedupes
		// them, so a duplicate submission enqueues nothing new either.
		for _, t := range []*tasks.Task{
			SendReceipt.New(Receipt{OrderID: resp.ID, Email: req.Email}),
			GenerateInvoice.New(Invoice{OrderID: resp.ID}),
			SyncAnalytics.New(Analytics{OrderID: resp.ID}),
		} {
			if _, err := a.Client.EnqueueTx(ctx, tx, t); err != nil {
				return err
			}
		}
		return tx.QueryRow(ctx, `SELECT email, amount, created_at FROM keel_example_orders WHERE id = $1`, resp.ID).
			Scan(&resp.Email, &resp.Amount, &resp.CreatedAt)
	})
	if errors.Is(err, errKeyReused) {
		httpError(w, http.StatusUnprocessableEntity, err.Error())
		return
	}
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	status := http.StatusCreated
	if resp.Duplicate {
		status = http.StatusOK
	}
	writeJSON(w, status, resp)
}

func (a *API) getOrder(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	id := r.PathValue("id")
	resp := OrderResponse{ID: id}
	err := a.Pool.QueryRow(ctx, `SELECT email, amount, created_at FROM keel_example_orders WHERE id = $1`, id).
		Scan(&resp.Email, &resp.Amount, &resp.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		httpError(w, http.StatusNotFound, "no such order")
		return
	}
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	jobs, err := OrderJobs(ctx, a.Client.Inspector(), id)
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	resp.Jobs = jobs
	writeJSON(w, http.StatusOK, resp)
}

// OrderJobs answers "what state are this order's jobs in?" from the ledger.
func OrderJobs(ctx context.Context, insp *inspect.Inspector, orderID string) ([]JobState, error) {
	var out []JobState
	for _, kind := range []string{SendReceipt.Name(), GenerateInvoice.Name(), SyncAnalytics.Name()} {
		j, err := insp.Lookup(ctx, kind, "order:"+orderID)
		if errors.Is(err, idempotency.ErrNotFound) {
			out = append(out, JobState{Kind: kind, Status: "none"})
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, JobState{Kind: kind, JobID: j.ID, Status: string(j.Status), Attempts: j.Attempts, LastError: j.LastError})
	}
	return out, nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}
