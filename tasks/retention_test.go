package tasks_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/tasks"
)

type note struct {
	ID string `json:"id"`
}

var noteKey = tasks.Key(func(n note) string { return n.ID })

// A kind's Keep and KeepDeadAtMost are its declared policies, one per
// status; a set of kinds gives them by name.
func TestKeepDeclaresAKindsRetention(t *testing.T) {
	day := 24 * time.Hour
	k := tasks.Define[note]("test:kept", noteKey, tasks.KeepDeadAtMost(500), tasks.Keep("succeeded", 7*day),
		tasks.Keep("dead", 90*day))
	want := []inspect.RetentionPolicy{
		{Kind: "test:kept", Status: "succeeded", Source: inspect.SourceCode, Keep: 7 * day},
		{Kind: "test:kept", Status: "dead", Source: inspect.SourceCode, Keep: 90 * day, MaxCount: 500},
	}
	require.Equal(t, want, k.Retention())
	require.Equal(t, want, tasks.NewKinds(k).Retention("test:kept"))
	require.Empty(t, tasks.NewKinds(k).Retention("test:other"))
	require.Empty(t, tasks.Define[note]("test:not_kept", noteKey).Retention())
}

// What a kind's retention cannot say stops the program at start, and a
// task refuses it: a policy is the kind's.
func TestKeepRefusesWhatCannotWork(t *testing.T) {
	for name, opts := range map[string][]tasks.Option{
		"an open status":              {tasks.Keep("pending", 48*time.Hour)},
		"below the floor":             {tasks.Keep("succeeded", time.Minute)},
		"shorter than Unique":         {tasks.Unique(72 * time.Hour), tasks.Keep("succeeded", 48*time.Hour)},
		"shorter than a later Unique": {tasks.Keep("cancelled", 48*time.Hour), tasks.Unique(72 * time.Hour)},
		"a negative count":            {tasks.KeepDeadAtMost(-1)},
	} {
		require.Panics(t, func() { tasks.Define[note]("test:bad_keep", append([]tasks.Option{noteKey}, opts...)...) }, name)
	}
	require.NotPanics(t, func() {
		tasks.Define[note]("test:keep_past_unique", noteKey, tasks.Unique(time.Hour), tasks.Keep("succeeded", 2*time.Hour))
	})
	k := tasks.Define[note]("test:task_keep", noteKey)
	task := k.New(note{ID: "1"}, tasks.Keep("succeeded", 48*time.Hour))
	err := tasks.CheckTasks([]string{"default"}, task)
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, `tasks.Keep("succeeded") is an option of tasks.Define`)
}
