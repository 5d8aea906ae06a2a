package inspect

import (
	"context"
	"fmt"

	"github.com/keeljobs/keel/internal/ledger"
)

// Related is a job at the other end of a dependency (tasks.After): a
// parent or a child, with its status.
type Related = ledger.Related

// Dependencies are the jobs a job waits (or waited) for and those that
// wait for it. A parent pruned since (it succeeded longer ago than the
// retention) is not listed.
type Dependencies struct {
	Parents, Children []Related
	// MoreParents and MoreChildren count those not listed
	// (DependenciesUpTo).
	MoreParents, MoreChildren int
}

// Waits names the parents a waiting job still waits for: those whose
// dependency is not met, a dead one among them (its replay would release
// the job).
func (d Dependencies) Waits() []Related {
	var out []Related
	for _, p := range d.Parents {
		if p.Status != ledger.StatusSucceeded && !p.Met {
			out = append(out, p)
		}
	}
	return out
}

// Dependencies returns job id's parents and children.
func (in *Inspector) Dependencies(ctx context.Context, id string) (Dependencies, error) {
	var d Dependencies
	var err error
	if d.Parents, err = ledger.ParentsOf(ctx, in.pool, id); err != nil {
		return d, interpret(err)
	}
	if d.Children, err = ledger.ChildrenOf(ctx, in.pool, id); err != nil {
		return d, interpret(err)
	}
	return d, nil
}

// DependenciesUpTo returns up to n of job id's parents, those not
// succeeded first (they are why a job waits), and up to n of its children,
// in id order, with the number of those not listed: what a page shows of a
// parent of many thousands of jobs, without reading them all.
func (in *Inspector) DependenciesUpTo(ctx context.Context, id string, n int) (Dependencies, error) {
	if n < 1 {
		return Dependencies{}, fmt.Errorf("keel inspect: a page of %d dependencies: want at least 1", n)
	}
	var d Dependencies
	var total int
	var err error
	if d.Parents, total, err = ledger.ParentsPage(ctx, in.pool, id, n); err != nil {
		return d, interpret(err)
	}
	d.MoreParents = total - len(d.Parents)
	if d.Children, total, err = ledger.ChildrenPage(ctx, in.pool, id, n); err != nil {
		return d, interpret(err)
	}
	d.MoreChildren = total - len(d.Children)
	return d, nil
}

// WorkflowNode is one job of a workflow: its task name, status and the
// ids of the jobs it waits for.
type WorkflowNode = ledger.WorkflowNode

// Workflow returns the jobs of workflow id (tasks.Workflow), parents
// before children; ErrNotFound when it has none.
func (in *Inspector) Workflow(ctx context.Context, id string) ([]WorkflowNode, error) {
	nodes, err := ledger.Workflow(ctx, in.pool, id)
	if err != nil {
		return nil, interpret(err)
	}
	if len(nodes) == 0 {
		return nil, fmt.Errorf("%w: no workflow with id %s", ErrNotFound, id)
	}
	return nodes, nil
}
