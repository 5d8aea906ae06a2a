package cli

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// A --concurrency-limit naming a kind the worker handles limits that kind
// though the program declares no kinds; a rule naming no kind handled here
// (misspelt, or a resource no handler of the worker can take) is said so
// at start.
func TestAConcurrencyLimitFindsItsKind(t *testing.T) {
	var log testenv.SyncBuffer
	lf := limitFlags{concurrency: []string{"report:daily=2", "report:dialy=3"}, rates: []string{"mail=50/1s"}}
	rules, err := lf.rules(App{})
	require.NoError(t, err)
	require.Len(t, rules, 3)
	rules = ruleKinds(slog.New(slog.NewTextHandler(&log, nil)), rules, []string{"report:daily", "mail:send"})
	require.Equal(t, []string{"report:daily"}, rules[0].Kinds)
	require.Empty(t, rules[1].Kinds)
	require.Contains(t, log.String(), "names no kind this worker handles")
	require.Contains(t, log.String(), "name=report:dialy")
	require.Contains(t, log.String(), "name=mail", "a resource: no handler of this worker can take it")
	require.NotContains(t, log.String(), "name=report:daily ")
}
