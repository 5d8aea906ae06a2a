package web

import (
	"context"
	"maps"
	"net/http"
	"sync"
	"time"

	"github.com/keeljobs/keel/inspect"
)

// A bulk action by filter can select tens of thousands of jobs: run inside
// the request, it outlived the server's write timeout (the operator got an
// empty reply while it went on) and stopped part-way when the browser or a
// proxy hung up. It runs in the background instead, detached from the
// request; the request waits bulkInlineWait for it, long enough for the
// usual few hundred jobs, and otherwise sends the operator to a page that
// shows its progress. Every job it acts on is in that job's audit log.
var bulkInlineWait = 5 * time.Second

// bulkKeep is how long a finished bulk action's result stays viewable.
const bulkKeep = time.Hour

// bulkRun is one bulk action running, or run, in the background.
type bulkRun struct {
	id, action, actor, backURL string
	finished                   time.Time
	done                       chan struct{}

	mu  sync.Mutex
	res inspect.BulkResult
}

func (b *bulkRun) result() (inspect.BulkResult, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	res := b.res
	res.Failed = maps.Clone(b.res.Failed)
	select {
	case <-b.done:
		return res, true
	default:
		return res, false
	}
}

// bulkRuns are the server's background bulk actions.
type bulkRuns struct {
	ctx    context.Context // ended by Close: a job's action in progress finishes, no other starts
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	runs   map[string]*bulkRun
}

func newBulkRuns() *bulkRuns {
	ctx, cancel := context.WithCancel(context.Background())
	return &bulkRuns{ctx: ctx, cancel: cancel, runs: map[string]*bulkRun{}}
}

func (br *bulkRuns) close() {
	br.cancel()
	br.wg.Wait()
}

// start runs a bulk action of n jobs in the background, then hands its
// result to finished. run reports its progress as it goes.
func (br *bulkRuns) start(action, actor, backURL string, n int,
	run func(ctx context.Context, progress func(inspect.BulkResult)) inspect.BulkResult, finished func(inspect.BulkResult)) *bulkRun {
	b := &bulkRun{id: randomHex(16), action: action, actor: actor, backURL: backURL, done: make(chan struct{}),
		res: inspect.BulkResult{Matched: n, Unchanged: map[string]string{}, Failed: map[string]error{}}}
	br.mu.Lock()
	for id, old := range br.runs {
		select {
		case <-old.done:
			if time.Since(old.finished) > bulkKeep {
				delete(br.runs, id)
			}
		default:
		}
	}
	br.runs[b.id] = b
	br.mu.Unlock()
	br.wg.Go(func() {
		defer close(b.done)
		set := func(res inspect.BulkResult) {
			b.mu.Lock()
			b.res = res
			b.mu.Unlock()
		}
		res := run(br.ctx, set)
		b.mu.Lock()
		b.res, b.finished = res, time.Now()
		b.mu.Unlock()
		finished(res)
	})
	return b
}

func (br *bulkRuns) get(id string) *bulkRun {
	br.mu.Lock()
	defer br.mu.Unlock()
	return br.runs[id]
}

// runBulk starts a bulk action and shows its result, or, if it is still
// running after bulkInlineWait, sends the operator to its progress page.
func (s *Server) runBulk(w http.ResponseWriter, r *http.Request, action inspect.Action, nav string, ids []string,
	backURL, note string, logged func(inspect.BulkResult)) {
	actor := principalFrom(r.Context()).Name
	b := s.bulks.start(string(action), actor, backURL, len(ids), func(ctx context.Context, progress func(inspect.BulkResult)) inspect.BulkResult {
		res, _ := s.ops.Bulk(ctx, action, ids, actor, note, progress)
		return res
	}, logged)
	t := time.NewTimer(bulkInlineWait)
	defer t.Stop()
	select {
	case <-b.done:
		res, _ := b.result()
		s.render(w, r, http.StatusOK, "bulk", view{Title: "Bulk " + string(action), Nav: nav,
			Data: bulkData{Action: string(action), Result: res, BackURL: backURL}})
	case <-t.C:
		http.Redirect(w, r, "/bulk/"+b.id, http.StatusSeeOther)
	case <-r.Context().Done():
		// The browser left; the action goes on, and its page shows it.
	}
}

// bulkProgress shows a background bulk action: how far it is, refreshing
// itself until it is done, then what it did.
func (s *Server) bulkProgress(w http.ResponseWriter, r *http.Request) {
	b := s.bulks.get(r.PathValue("id"))
	if b == nil {
		s.errorPage(w, r, http.StatusNotFound, "no such bulk action on this server: it finished over an hour ago, "+
			"or this server restarted (each job's page shows what was done to it)")
		return
	}
	res, finished := b.result()
	v := view{Title: "Bulk " + b.action, Nav: "dead",
		Data: bulkData{Action: b.action, Result: res, BackURL: b.backURL, Running: !finished, Actor: b.actor}}
	if !finished {
		v.Refresh = 2
	}
	s.render(w, r, http.StatusOK, "bulk", v)
}
