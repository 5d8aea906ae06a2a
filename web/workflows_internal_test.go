package web

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// A task's column is its longest path from a root, a line that skips a
// column included; a parent outside the workflow draws no line.
func TestWorkflowLayout(t *testing.T) {
	t.Parallel()
	node := func(id string, parents ...string) inspect.WorkflowNode {
		n := inspect.WorkflowNode{Task: id, Parents: parents}
		n.ID = id
		return n
	}
	nodes := []inspect.WorkflowNode{node("a"), node("x", "elsewhere"), node("b", "a"), node("c", "a", "b"), node("y", "x")}
	depth, order := layout(nodes)
	require.Equal(t, []int{0, 0, 1, 2, 1}, depth)
	// In column 1, b (under a, row 0) comes before y (under x, row 1).
	require.Equal(t, []int{0, 1, 2, 4, 3}, order)

	g := drawWorkflow(nodes, depth, order)
	require.Len(t, g.Nodes, 5)
	require.Len(t, g.Edges, 4)
	at := map[string]graphNode{}
	for _, n := range g.Nodes {
		at[n.ID] = n
	}
	require.Less(t, at["a"].X, at["b"].X)
	require.Less(t, at["b"].X, at["c"].X)
	require.Equal(t, at["a"].X, at["x"].X)
	require.Less(t, at["b"].Y, at["y"].Y)
	require.Equal(t, 2*graphPad+3*nodeW+2*colGap, g.W)
	require.Equal(t, 2*graphPad+2*nodeH+rowGap, g.H)

	// A cycle (keel refuses to write one) does not hang the page.
	depth, _ = layout([]inspect.WorkflowNode{node("p", "q"), node("q", "p")})
	require.Len(t, depth, 2)

	// Too many tasks to draw: listed only.
	var many []inspect.WorkflowNode
	for i := range graphMaxNodes + 1 {
		n := node(strconv.Itoa(i))
		n.Status = idempotency.StatusPending
		many = append(many, n)
	}
	d := newWorkflowData("big", many)
	require.True(t, d.TooBig)
	require.Nil(t, d.Graph)
	require.Len(t, d.Rows, graphMaxNodes+1)
	require.Equal(t, []statusCount{{Status: idempotency.StatusPending, N: graphMaxNodes + 1}}, d.Counts)
}
