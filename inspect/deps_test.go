package inspect_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
)

// ids lists the ids of related jobs, in order.
func ids(rs []inspect.Related) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.ID
	}
	return out
}

// A job with more dependencies than a page shows (the dashboard's job page)
// has some listed, parents still waited for first, and the rest counted;
// a pruned parent is neither.
func TestDependenciesUpToListsSomeAndCountsTheRest(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var parents, children []string
	for _, shape := range []string{"succeeded", "succeeded", "dead", "pending"} {
		parents = append(parents, b.put(t, "deps", shape))
	}
	job := b.put(t, "deps", "pending")
	for range 5 {
		children = append(children, b.put(t, "deps", "pending"))
	}
	for _, p := range parents {
		_, err := b.pool.Exec(ctx, `INSERT INTO keel_job_deps (parent_id, child_id) VALUES ($1, $2)`, p, job)
		require.NoError(t, err)
	}
	for _, c := range children {
		_, err := b.pool.Exec(ctx, `INSERT INTO keel_job_deps (parent_id, child_id) VALUES ($1, $2)`, job, c)
		require.NoError(t, err)
	}

	d, err := b.ops.DependenciesUpTo(ctx, job, 2)
	require.NoError(t, err)
	require.Equal(t, parents[2:], ids(d.Parents), "the parents not succeeded come first")
	require.Equal(t, 2, d.MoreParents)
	require.Equal(t, children[:2], ids(d.Children))
	require.Equal(t, 3, d.MoreChildren)

	_, err = b.pool.Exec(ctx, `DELETE FROM keel_jobs WHERE id = $1`, parents[0])
	require.NoError(t, err)
	d, err = b.ops.DependenciesUpTo(ctx, job, 2)
	require.NoError(t, err)
	require.Equal(t, 1, d.MoreParents, "a pruned parent is not counted")

	d, err = b.ops.DependenciesUpTo(ctx, job, 10)
	require.NoError(t, err)
	require.Equal(t, []string{parents[2], parents[3], parents[1]}, ids(d.Parents))
	require.Equal(t, children, ids(d.Children))
	require.Zero(t, d.MoreParents)
	require.Zero(t, d.MoreChildren)

	all, err := b.ops.Dependencies(ctx, job)
	require.NoError(t, err)
	require.Equal(t, parents[1:], ids(all.Parents), "Dependencies lists every parent, in id order")
	require.Equal(t, children, ids(all.Children))

	_, err = b.ops.DependenciesUpTo(ctx, job, 0)
	require.Error(t, err, "a page of nothing")
}
