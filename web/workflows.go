package web

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// Dependencies on the job page, the workflow page (/workflows/{id}) with
// its graph, and the Release button of a waiting job.

// relatedShown bounds the parents and the children a job's page lists: a
// fan-out may have thousands.
const relatedShown = 100

// depsView is the job page's section on what a job waits for and what
// waits for it.
type depsView struct {
	Parents, Children []inspect.Related
	// MoreParents, MoreChildren: those not listed (relatedShown).
	MoreParents, MoreChildren int
	// Waiting: the job waits for its parents.
	Waiting                  bool
	WorkflowID, WorkflowTask string
	WorkflowURL              string
}

// jobDeps reads job j's dependencies; nil when it has none and is in no
// workflow.
func (s *Server) jobDeps(ctx context.Context, j idempotency.Job) (*depsView, error) {
	deps, err := s.ops.DependenciesUpTo(ctx, j.ID, relatedShown)
	if err != nil {
		return nil, err
	}
	// A job held for its concurrency key waits for a slot, not for parents.
	waiting := j.Status == idempotency.StatusWaiting && !j.HeldForKey()
	if len(deps.Parents) == 0 && len(deps.Children) == 0 && j.WorkflowID == "" && !waiting {
		return nil, nil
	}
	d := &depsView{Parents: deps.Parents, Children: deps.Children, MoreParents: deps.MoreParents,
		MoreChildren: deps.MoreChildren, Waiting: waiting, WorkflowID: j.WorkflowID, WorkflowTask: j.WorkflowTask}
	if j.WorkflowID != "" {
		d.WorkflowURL = workflowURL(j.WorkflowID)
	}
	return d, nil
}

// workflowURL is the page of workflow id, an id of the caller's that may
// hold any character.
func workflowURL(id string) string { return "/workflows/" + url.PathEscape(id) }

// releaseJob is the job page's Release button: a waiting job starts
// without waiting for its parents.
func (s *Server) releaseJob(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	note := strings.TrimSpace(r.PostForm.Get("note"))
	res, err := s.ops.Release(r.Context(), id, p.Name, note)
	if err != nil {
		s.actionFailed(w, r, id, "release", err, note)
		return
	}
	done := "released"
	if res.AlreadyReleased {
		done = "already-released"
	}
	s.cfg.Logger.Info("keel web: job released", "job_id", id, "actor", p.Name, "already", res.AlreadyReleased)
	http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done="+done, http.StatusSeeOther)
}

// lookupWorkflow sends the look-up of a workflow id to its page.
func (s *Server) lookupWorkflow(w http.ResponseWriter, r *http.Request, d lookupData) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	_, err := s.ops.Workflow(ctx, d.Workflow)
	switch {
	case errors.Is(err, inspect.ErrNotFound):
		s.render(w, r, http.StatusNotFound, "lookup", view{Title: "Look up a job", Nav: "lookup",
			Error: fmt.Sprintf("no workflow with id %q", d.Workflow), Data: d})
	case err != nil:
		s.ledgerError(w, r, err)
	default:
		http.Redirect(w, r, workflowURL(d.Workflow), http.StatusSeeOther)
	}
}

// graphMaxNodes bounds the workflows drawn: a larger one is listed only,
// as a drawing of it would be too big to read.
const graphMaxNodes = 300

// The graph's geometry, in SVG units (CSS pixels at full size).
const (
	nodeW, nodeH   = 168, 40
	colGap, rowGap = 64, 18
	graphPad       = 12
	labelRunes     = 22
)

// workflowGraph is a workflow drawn as inline SVG: a column per depth
// (the longest path from a task that waits for nothing), a box per task,
// a line from each parent to its child.
type workflowGraph struct {
	W, H         int
	NodeW, NodeH int
	Nodes        []graphNode
	Edges        []graphEdge
}

type graphNode struct {
	inspect.WorkflowNode
	X, Y  int
	Label string // the task name, clipped to fit its box
}

type graphEdge struct {
	From, To string
	// Met: the dependency is met (the parent succeeded, or died after its
	// completing InTx had committed).
	Met  bool
	Path string // the SVG path's d
}

// workflowRow is a line of the workflow page's table of tasks.
type workflowRow struct {
	inspect.WorkflowNode
	Depth int
	// After are the tasks it waits for; Outside, parents not in the
	// workflow (tasks.After naming another job).
	After   []string
	Outside []string
}

type statusCount struct {
	Status idempotency.Status
	N      int
}

type workflowData struct {
	ID     string
	Rows   []workflowRow
	Counts []statusCount
	Graph  *workflowGraph
	// TooBig: more tasks than graphMaxNodes, so no graph is drawn.
	TooBig bool
}

// statusOrder is the order the workflow page counts statuses in: those
// still to run first.
var statusOrder = []idempotency.Status{idempotency.StatusWaiting, idempotency.StatusPending, idempotency.StatusPaused, idempotency.StatusRunning,
	idempotency.StatusFailed, idempotency.StatusDead, idempotency.StatusSucceeded, idempotency.StatusCancelled, idempotency.StatusDiscarded}

func (s *Server) workflow(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	id := r.PathValue("id")
	nodes, err := s.ops.Workflow(ctx, id)
	if errors.Is(err, inspect.ErrNotFound) {
		s.errorPage(w, r, http.StatusNotFound, fmt.Sprintf("no workflow with id %q", id))
		return
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	s.render(w, r, http.StatusOK, "workflow", view{Title: "Workflow " + id, Nav: "jobs", Data: newWorkflowData(id, nodes)})
}

// newWorkflowData lays out workflow id's nodes for its page.
func newWorkflowData(id string, nodes []inspect.WorkflowNode) workflowData {
	d := workflowData{ID: id}
	depth, order := layout(nodes)
	byID := make(map[string]inspect.WorkflowNode, len(nodes))
	for _, n := range nodes {
		byID[n.ID] = n
	}
	n := map[idempotency.Status]int{}
	for _, i := range order {
		row := workflowRow{WorkflowNode: nodes[i], Depth: depth[i]}
		for _, p := range nodes[i].Parents {
			if pn, ok := byID[p]; ok {
				row.After = append(row.After, pn.Task)
			} else {
				row.Outside = append(row.Outside, p)
			}
		}
		d.Rows = append(d.Rows, row)
		n[nodes[i].Status]++
	}
	for _, st := range statusOrder {
		if n[st] > 0 {
			d.Counts = append(d.Counts, statusCount{Status: st, N: n[st]})
		}
	}
	if d.TooBig = len(nodes) > graphMaxNodes; !d.TooBig {
		d.Graph = drawWorkflow(nodes, depth, order)
	}
	return d
}

// layout gives each node its depth, the longest path to it from a node
// with no parent in the workflow, and an order to draw them in: by depth,
// and in a column by where their parents stand (fewer crossing lines),
// else as listed.
func layout(nodes []inspect.WorkflowNode) (depth, order []int) {
	idx := make(map[string]int, len(nodes))
	for i, n := range nodes {
		idx[n.ID] = i
	}
	depth = make([]int, len(nodes))
	state := make([]int8, len(nodes)) // 0 not seen, 1 in progress, 2 done
	var visit func(i int) int
	visit = func(i int) int {
		switch state[i] {
		case 2:
			return depth[i]
		case 1:
			return 0 // a cycle: keel refuses to write one, but a page must not recurse forever
		}
		state[i] = 1
		d := 0
		for _, p := range nodes[i].Parents {
			if j, ok := idx[p]; ok {
				d = max(d, visit(j)+1)
			}
		}
		depth[i], state[i] = d, 2
		return d
	}
	for i := range nodes {
		visit(i)
	}
	// Sort column after column: a node's key is the mean row of its
	// parents, which the columns before it have fixed.
	row := make([]float64, len(nodes))
	order = make([]int, len(nodes))
	for i := range order {
		order[i] = i
	}
	key := make([]float64, len(nodes))
	maxDepth := 0
	for _, d := range depth {
		maxDepth = max(maxDepth, d)
	}
	var out []int
	for col := 0; col <= maxDepth; col++ {
		var in []int
		for _, i := range order {
			if depth[i] != col {
				continue
			}
			in = append(in, i)
			sum, k := 0.0, 0
			for _, p := range nodes[i].Parents {
				if j, ok := idx[p]; ok {
					sum += row[j]
					k++
				}
			}
			key[i] = float64(i)
			if k > 0 {
				key[i] = sum / float64(k)
			}
		}
		if col > 0 {
			slices.SortStableFunc(in, func(a, b int) int { return cmp.Compare(key[a], key[b]) })
		}
		for r, i := range in {
			row[i] = float64(r)
		}
		out = append(out, in...)
	}
	return depth, out
}

// drawWorkflow places the nodes, in columns by depth, each column centred
// on the tallest, and draws a curve from each parent to its child.
func drawWorkflow(nodes []inspect.WorkflowNode, depth, order []int) *workflowGraph {
	perCol := map[int]int{}
	cols, rows := 0, 0
	for _, i := range order {
		perCol[depth[i]]++
		cols = max(cols, depth[i]+1)
		rows = max(rows, perCol[depth[i]])
	}
	g := &workflowGraph{NodeW: nodeW, NodeH: nodeH, W: 2*graphPad + cols*nodeW + (cols-1)*colGap, H: 2*graphPad + rows*nodeH + (rows-1)*rowGap}
	at := make(map[string]int, len(nodes)) // job id → index in g.Nodes
	next := map[int]int{}
	for _, i := range order {
		c := depth[i]
		shift := (rows - perCol[c]) * (nodeH + rowGap) / 2
		x := graphPad + c*(nodeW+colGap)
		y := graphPad + shift + next[c]*(nodeH+rowGap)
		next[c]++
		at[nodes[i].ID] = len(g.Nodes)
		g.Nodes = append(g.Nodes, graphNode{WorkflowNode: nodes[i], X: x, Y: y, Label: clip(nodes[i].Task, labelRunes)})
	}
	for _, child := range g.Nodes {
		for k, pid := range child.Parents {
			pi, ok := at[pid]
			if !ok {
				continue // a parent outside the workflow: the table lists it
			}
			parent := g.Nodes[pi]
			x1, y1 := parent.X+nodeW, parent.Y+nodeH/2
			x2, y2 := child.X-2, child.Y+nodeH/2 // short of the box, for the arrow head
			bend := (x2 - x1) / 2
			met := parent.Status == idempotency.StatusSucceeded || k < len(child.ParentsMet) && child.ParentsMet[k]
			g.Edges = append(g.Edges, graphEdge{From: parent.ID, To: child.ID, Met: met,
				Path: fmt.Sprintf("M%d %d C%d %d %d %d %d %d", x1, y1, x1+bend, y1, x2-bend, y2, x2, y2)})
		}
	}
	return g
}
