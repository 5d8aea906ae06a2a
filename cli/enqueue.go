package cli

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// maxInputBytes bounds what enqueue reads for one payload or one --from
// line: a payload over tasks.MaxPayloadBytes is refused by the client with
// its own message, anything much larger is a mistake.
const maxInputBytes = 4 * tasks.MaxPayloadBytes

// enqueueBatch is how many jobs of --from go into the ledger per statement
// and commit.
const enqueueBatch = 1000

// jobLine is one job of `enqueue --from`: one JSON object per line.
type jobLine struct {
	Kind     string          `json:"kind"`
	Key      string          `json:"key"`
	Payload  json.RawMessage `json:"payload"`
	Queue    string          `json:"queue"`
	Delay    string          `json:"delay"`
	MaxRetry *int            `json:"max_retry"`
}

// enqueueResult is what enqueue prints per job.
type enqueueResult struct {
	Line        int    `json:"line,omitempty"`
	ID          string `json:"id,omitempty"`
	Kind        string `json:"kind"`
	BusinessKey string `json:"business_key"`
	Queue       string `json:"queue"`
	Status      string `json:"status,omitempty"`
	Existed     bool   `json:"existed"`
	// PayloadDiffers: the job existed with another payload, which it keeps.
	PayloadDiffers bool `json:"payload_differs,omitempty"`
}

func enqueueCmd(e *Env) *cobra.Command {
	var payload, payloadFile, from, queue string
	var delay time.Duration
	var maxRetry int
	var dryRun bool
	var after []string
	cmd := &cobra.Command{
		Use:   "enqueue KIND [BUSINESS_KEY] | enqueue --from FILE",
		Short: "Enqueue jobs through the ledger (the same kind and key twice is one job)",
		Long: `Enqueue one job, or many with --from: a file (or - for stdin) of JSON lines,
one job each:

  {"kind": "user:send_welcome", "key": "user:42", "payload": {"user_id": "42"}, "queue": "default", "delay": "10s", "max_retry": 3}

Only kind and payload are needed when the program declares the kind: its
payload is decoded into the kind's type (unknown fields are refused) and the
business key comes from the kind's Key. Every line is checked before the
first job is enqueued.

With --after, the job waits (status waiting) until every job named has
succeeded, as tasks.After makes it; a job named that does not exist, or was
cancelled or discarded, refuses it.`,
		Example: "  keel enqueue user:send_welcome user:42 --payload '{\"user_id\":\"42\"}'\n" +
			"  keel enqueue user:send_welcome --payload-file welcome.json\n" +
			"  keel enqueue --from jobs.jsonl\n" +
			"  keel enqueue user:send_digest user:42 --payload '{\"user_id\":\"42\"}' --after JOB_ID",
		Args: cobra.RangeArgs(0, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			f := cmd.Flags()
			var jobs []*tasks.Task
			var lines []int
			if from != "" {
				if len(args) > 0 || f.Changed("payload") || payloadFile != "" || f.Changed("queue") || f.Changed("delay") || f.Changed("max-retry") || f.Changed("after") {
					return usageError{errors.New("--from takes each job's kind, key, payload and options from its lines: give no KIND, key or job flags with it")}
				}
				r, closeFn, err := openInput(cmd, from)
				if err != nil {
					return err
				}
				jobs, lines, err = readJobLines(e.app, r, from)
				closeFn()
				if err != nil {
					return err
				}
			} else {
				if len(args) == 0 {
					return usageError{errors.New("give KIND [BUSINESS_KEY], or --from FILE")}
				}
				if f.Changed("payload") && payloadFile != "" {
					return usageError{errors.New("give --payload or --payload-file, not both")}
				}
				body := []byte(payload)
				if payloadFile != "" {
					r, closeFn, err := openInput(cmd, payloadFile)
					if err != nil {
						return err
					}
					body, err = io.ReadAll(io.LimitReader(r, maxInputBytes+1))
					closeFn()
					if err != nil {
						return fmt.Errorf("--payload-file %s: %w", payloadFile, err)
					}
					if len(body) > maxInputBytes {
						return usageError{fmt.Errorf("--payload-file %s: over %d bytes (the payload limit is %d: pass large data by id)", payloadFile, maxInputBytes, tasks.MaxPayloadBytes)}
					}
				}
				var opts []tasks.Option
				if queue != "" {
					opts = append(opts, tasks.Queue(queue))
				}
				if delay < 0 {
					return usageError{errors.New("--delay must not be negative")}
				}
				if delay > 0 {
					opts = append(opts, tasks.Delay(delay))
				}
				if f.Changed("max-retry") {
					opts = append(opts, tasks.MaxRetry(maxRetry))
				}
				for i := range after {
					after[i] = strings.TrimSpace(after[i])
				}
				if after = slices.DeleteFunc(after, func(id string) bool { return id == "" }); len(after) > 0 {
					opts = append(opts, tasks.After(after...))
				} else if f.Changed("after") {
					return usageError{errors.New("--after needs a job id")}
				}
				key := ""
				if len(args) == 2 {
					key = args[1]
				}
				t, err := newTask(e.app, args[0], bytes.TrimSpace(body), key, opts)
				if err != nil {
					return usageError{err}
				}
				jobs, lines = []*tasks.Task{t}, []int{0}
			}
			queues, err := enqueueQueues()
			if err != nil {
				return err
			}
			// What only the client checks (the queue, the retry budget, the
			// key's and payload's limits), for every job before the first
			// batch goes in.
			if err := tasks.CheckTasks(queues, jobs...); err != nil {
				var te *tasks.TaskError
				switch {
				case !errors.As(err, &te):
					return usageError{err}
				case from == "":
					return usageError{te.Err}
				}
				return usageError{fmt.Errorf("%s line %d: %w; nothing was enqueued", from, lines[te.Index], te.Err)}
			}
			out := cmd.OutOrStdout()
			if dryRun {
				return printDryRun(e, out, jobs, lines)
			}
			ctx := cmd.Context()
			redis, err := e.Redis(ctx)
			if err != nil {
				return err
			}
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool, Logger: e.Logger(), Queues: queues})
			if err != nil {
				return err
			}
			defer client.Close()
			var bar *progress
			if len(jobs) > 1 {
				bar = newProgress(cmd.ErrOrStderr(), "enqueue", len(jobs))
			}
			results := make([]enqueueResult, 0, len(jobs))
			created := 0
			// Batches of enqueueBatch jobs, each one statement and one
			// commit (EnqueueMany): a batch goes in whole or not at all.
			for start := 0; start < len(jobs); start += enqueueBatch {
				batch := jobs[start:min(start+enqueueBatch, len(jobs))]
				var res []*tasks.Result
				if len(after) > 0 {
					// EnqueueMany takes no dependencies; one job.
					var r *tasks.Result
					if r, err = client.Enqueue(ctx, batch[0]); err == nil {
						res = []*tasks.Result{r}
					}
				} else {
					res, err = client.EnqueueMany(ctx, batch...)
				}
				if err != nil {
					bar.clear()
					if from == "" {
						var te *tasks.TaskError
						if errors.As(err, &te) {
							return te.Err
						}
						return err
					}
					done := "nothing was enqueued"
					if start > 0 {
						done = fmt.Sprintf("the %d job(s) before line %d were enqueued", start, lines[start])
					}
					var te *tasks.TaskError
					if errors.As(err, &te) {
						return fmt.Errorf("%s line %d: %w (%s)", from, lines[start+te.Index], te.Err, done)
					}
					return fmt.Errorf("%s: %w (%s)", from, err, done)
				}
				for i, r := range res {
					if !r.Existed {
						created++
					}
					results = append(results, enqueueResult{Line: lines[start+i], ID: r.Job.ID, Kind: r.Job.Kind, BusinessKey: r.Job.BusinessKey,
						Queue: r.Job.Queue, Status: string(r.Job.Status), Existed: r.Existed, PayloadDiffers: r.PayloadDiffers})
				}
				bar.set(len(results))
			}
			bar.done()
			if e.JSON() {
				if from == "" {
					return printJSON(out, results[0])
				}
				return printJSON(out, map[string]any{"created": created, "existed": len(results) - created, "jobs": results})
			}
			if from == "" {
				r := results[0]
				state := "created"
				if r.Existed {
					state = "already existed"
				}
				if r.PayloadDiffers {
					state += " with another payload, which it keeps"
				}
				fmt.Fprintf(out, "job %s %s (status %s, queue %s, business key %s)\n", r.ID, state, r.Status, oneRow(r.Queue), oneRow(r.BusinessKey))
				if r.Existed && r.Status == string(idempotency.StatusDead) {
					fmt.Fprintf(out, "it is dead: %[1]s dead show %[2]s says why, %[1]s dead replay %[2]s runs it again\n", e.app.name(), r.ID)
				}
				return nil
			}
			fmt.Fprintf(out, "%d job(s) from %s: %d created, %d already existed\n", len(results), from, created, len(results)-created)
			var differs, dead int
			for _, r := range results {
				if r.PayloadDiffers {
					differs++
				}
				if r.Existed && r.Status == string(idempotency.StatusDead) {
					dead++
				}
			}
			if differs > 0 {
				fmt.Fprintf(out, "%d of them existed with another payload, which the job keeps (--json names them)\n", differs)
			}
			if dead > 0 {
				fmt.Fprintf(out, "%d of them are dead jobs, which stay dead: %s dead replay runs them again\n", dead, e.app.name())
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&payload, "payload", "", "JSON payload (required for a kind the program declares; otherwise default {})")
	fl.StringVar(&payloadFile, "payload-file", "", "read the JSON payload from this file (- for stdin)")
	fl.StringVar(&from, "from", "", "enqueue many jobs: a file of JSON lines (- for stdin), see above")
	fl.StringVar(&queue, "queue", "", "queue (default: the kind's queue, or default)")
	fl.DurationVar(&delay, "delay", 0, "run no earlier than this from now")
	fl.IntVar(&maxRetry, "max-retry", 0, "retry budget (default: the kind's, or "+strconv.Itoa(tasks.DefaultMaxRetry)+")")
	fl.BoolVar(&dryRun, "dry-run", false, "check the jobs and print them; enqueue nothing")
	fl.StringSliceVar(&after, "after", nil, "wait until this job has succeeded (a job id; repeat it, or separate ids with commas, for several)")
	return cmd
}

// enqueueQueues are the queues enqueue accepts besides a declared kind's
// own: tasks.DefaultQueues and those KEEL_QUEUES gives the workers.
func enqueueQueues() ([]string, error) {
	qs := slices.Clone(tasks.DefaultQueues)
	v := os.Getenv("KEEL_QUEUES")
	if v == "" {
		return qs, nil
	}
	parsed, err := server.ParseQueues(v)
	if err != nil {
		return nil, usageError{fmt.Errorf("KEEL_QUEUES: %w", err)}
	}
	var more []string
	for q := range parsed {
		if !slices.Contains(qs, q) {
			more = append(more, q)
		}
	}
	slices.Sort(more)
	return append(qs, more...), nil
}

// newTask checks a job given on the command line or in a --from line: a
// kind the program declares, a payload of the kind's type, a key.
func newTask(app App, kind string, payload []byte, key string, opts []tasks.Option) (*tasks.Task, error) {
	if !app.known(kind) {
		return nil, fmt.Errorf("%s does not declare the kind %q (its kinds: %s)", app.name(), kind, strings.Join(app.kindNames(), ", "))
	}
	declared := app.Kinds.Known(kind)
	if declared && (len(payload) == 0 || string(payload) == "null") {
		// The zero value would make a job for nobody ("order:" for no
		// order) and keep its key: a forgotten --payload, or an empty
		// shell variable, is a mistake, not {}.
		return nil, fmt.Errorf("no payload: give the %s job's payload (--payload JSON, --payload-file FILE, or \"payload\" in a --from line); its business key comes from it", kind)
	}
	if len(payload) == 0 {
		payload = []byte("{}")
	}
	if !json.Valid(payload) {
		return nil, fmt.Errorf("the payload is not valid JSON: %q", oneLine(string(payload), 80))
	}
	if !utf8.Valid(payload) {
		// Decoding would make its bad bytes U+FFFD: two payloads, one key.
		return nil, fmt.Errorf("the payload is not valid UTF-8: %q", oneLine(string(payload), 80))
	}
	if declared {
		t, err := app.Kinds.NewJSON(kind, payload, opts...)
		if err != nil || key == "" || t.BusinessKey() == key {
			return t, err
		}
		// One business action, one key: a key that is not the one the
		// kind derives (the order id typed for "order:123") would make a
		// second job, and a second effect, for the same action.
		if d := t.BusinessKey(); d != "" {
			return nil, fmt.Errorf("the kind %s derives the business key %q from this payload, not %q: leave the key out (a second key for one action would make a second job)",
				kind, d, key)
		}
		return app.Kinds.NewJSON(kind, payload, append(opts, tasks.BusinessKey(key))...)
	}
	if key == "" {
		return nil, fmt.Errorf("give a business key: %s does not declare the kind %q, so it cannot derive one", app.name(), kind)
	}
	return tasks.NewRaw(kind, payload, key, opts...), nil
}

// openInput opens name, or stdin for "-".
func openInput(cmd *cobra.Command, name string) (io.Reader, func(), error) {
	if name == "-" {
		return cmd.InOrStdin(), func() {}, nil
	}
	f, err := os.Open(name)
	if err != nil {
		return nil, nil, usageError{err}
	}
	return f, func() { f.Close() }, nil
}

// readJobLines reads and checks every line of an --from input; an error
// names the line.
func readJobLines(app App, r io.Reader, name string) ([]*tasks.Task, []int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), maxInputBytes)
	var jobs []*tasks.Task
	var lines []int
	n := 1
	for ; sc.Scan(); n++ {
		text := bytes.TrimSpace(sc.Bytes())
		if n == 1 {
			text = bytes.TrimPrefix(text, []byte("\ufeff")) // a byte-order mark
		}
		if len(text) == 0 || text[0] == '#' {
			continue
		}
		fail := func(format string, a ...any) error {
			return usageError{fmt.Errorf("%s line %d: %s; nothing was enqueued", name, n, fmt.Sprintf(format, a...))}
		}
		var l jobLine
		dec := json.NewDecoder(bytes.NewReader(text))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&l); err != nil {
			return nil, nil, fail("not a job (want {\"kind\", \"key\", \"payload\", \"queue\", \"delay\", \"max_retry\"}): %v", err)
		}
		if dec.InputOffset() != int64(len(text)) {
			// Decode stops after the first value: the rest would be lost.
			return nil, nil, fail("more than one JSON value (one job a line)")
		}
		if l.Kind == "" {
			return nil, nil, fail("no kind")
		}
		var opts []tasks.Option
		if l.Queue != "" {
			opts = append(opts, tasks.Queue(l.Queue))
		}
		if l.Delay != "" {
			d, err := time.ParseDuration(l.Delay)
			if err != nil || d < 0 {
				return nil, nil, fail("delay %q: want a duration like 10s", l.Delay)
			}
			opts = append(opts, tasks.Delay(d))
		}
		if l.MaxRetry != nil {
			opts = append(opts, tasks.MaxRetry(*l.MaxRetry))
		}
		t, err := newTask(app, l.Kind, l.Payload, l.Key, opts)
		if err != nil {
			return nil, nil, fail("%v", err)
		}
		jobs = append(jobs, t)
		lines = append(lines, n)
	}
	if err := sc.Err(); errors.Is(err, bufio.ErrTooLong) {
		return nil, nil, usageError{fmt.Errorf("%s line %d: longer than %d bytes; nothing was enqueued", name, n, maxInputBytes)}
	} else if err != nil {
		return nil, nil, usageError{fmt.Errorf("%s: %w", name, err)}
	}
	if len(jobs) == 0 {
		return nil, nil, usageError{fmt.Errorf("%s holds no jobs", name)}
	}
	return jobs, lines, nil
}

// dryRunResult is a job a dry run checked: whether it exists is not looked
// up, so it is not said.
type dryRunResult struct {
	Line        int    `json:"line,omitempty"`
	Kind        string `json:"kind"`
	BusinessKey string `json:"business_key"`
	Queue       string `json:"queue"`
}

func printDryRun(e *Env, out io.Writer, jobs []*tasks.Task, lines []int) error {
	results := make([]dryRunResult, 0, len(jobs))
	for i, t := range jobs {
		results = append(results, dryRunResult{Line: lines[i], Kind: t.Kind(), BusinessKey: t.BusinessKey(), Queue: t.Queue()})
	}
	if e.JSON() {
		return printJSON(out, map[string]any{"dry_run": true, "jobs": results})
	}
	fmt.Fprintf(out, "dry run: %d job(s) checked; nothing was enqueued\n", len(jobs))
	for _, r := range results {
		fmt.Fprintf(out, "  would enqueue %s %s on queue %s\n", oneRow(r.Kind), oneRow(r.BusinessKey), oneRow(r.Queue))
	}
	return nil
}
