package scheduler_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/scheduler"
)

// The README shows examples/schedule.yaml: it must load and name kinds the
// example handlers declare.
func TestExampleScheduleLoads(t *testing.T) {
	entries, err := scheduler.LoadFile(filepath.Join("..", "examples", "schedule.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, entries)
	require.NoError(t, scheduler.ValidateEntries(entries, handlers.Kinds.Known))

	nightly := entries[1]
	require.Equal(t, "nightly-analytics", nightly.Name)
	require.JSONEq(t, `{"order_id":"nightly"}`, string(nightly.Payload))
	require.Equal(t, "low", nightly.Queue)
	require.Equal(t, 3, *nightly.MaxRetry)
	require.Equal(t, 5*time.Minute, nightly.Timeout)
	next, err := nightly.Next(time.Date(2030, 7, 1, 12, 0, 0, 0, time.UTC))
	require.NoError(t, err)
	require.Equal(t, time.Date(2030, 7, 2, 0, 0, 0, 0, time.UTC), next.UTC(), "02:00 in Berlin's summer is 00:00 UTC")
}

func TestLoadFileErrorsNameFileLineEntryAndField(t *testing.T) {
	for _, tc := range []struct {
		name, body, want string
	}{
		{"unknown field", `
entries:
  - name: nightly-report
    shedule: "0 2 * * *"
`, `:4: schedule entry "nightly-report": unknown field "shedule"`},
		{"bad spec", `
entries:
  - name: nightly-report
    kind: report:daily
    spec: "* * *"
`, `:5: schedule entry "nightly-report": bad spec "* * *"`},
		{"bad time zone", `
entries:
  - name: nightly-report
    spec: "@daily"
    timezone: Mars/Olympus_Mons
    kind: report:daily
`, `:5: schedule entry "nightly-report": bad timezone "Mars/Olympus_Mons"`},
		{"bad timeout", `
entries:
  - kind: report:daily
    timeout: 5 minutes
    name: nightly-report
`, `:4: schedule entry "nightly-report": bad timeout: "5 minutes" is not a duration`},
		{"bad max_retry", `
entries:
  - name: nightly-report
    max_retry: many
`, `:4: schedule entry "nightly-report": bad max_retry: "many" is not a whole number`},
		{"payload key not a plain value", `
entries:
  - name: nightly-report
    payload:
      ? [a, b]
      : c
`, `:5: schedule entry "nightly-report": bad payload: a key is a list, mapping or merge`},
		{"payload number with no JSON form", `
entries:
  - name: nightly-report
    payload: {ratio: .inf}
`, `:4: schedule entry "nightly-report": bad payload: ratio: .inf has no JSON form`},
		{"field twice", `
entries:
  - name: nightly-report
    spec: "@daily"
    spec: "@hourly"
`, `:5: schedule entry "nightly-report": spec given twice`},
		{"duplicate name", `
entries:
  - name: a
    spec: "@daily"
    kind: k
  - name: a
    spec: "@hourly"
    kind: k
`, `:6: schedule entry "a": duplicate name: entries #1 and #2`},
		{"no name", `
entries:
  - spec: "@daily"
    kind: k
`, `:3: schedule entry #1: bad name "": empty`},
		{"unquoted descriptor", `
entries:
  - name: a
    spec: @daily
`, `yaml: line 4`},
		{"unknown top key", "entry:\n  - name: a\n", `:1: unknown key "entry"`},
		{"entries not a list", "entries: {}\n", `:1: entries: want a list`},
		{"empty", "", `empty`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "schedule.yaml")
			require.NoError(t, os.WriteFile(path, []byte(tc.body), 0o600))
			_, err := scheduler.LoadFile(path)
			require.ErrorContains(t, err, path)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := scheduler.LoadFile(filepath.Join(t.TempDir(), "missing.yaml"))
	require.ErrorContains(t, err, "missing.yaml")
}

func TestParseFilePayloads(t *testing.T) {
	entries, err := scheduler.ParseFile("inline", []byte(`
entries:
  - name: defaults
    spec: "@hourly"
    kind: k
  - name: nested
    spec: "@hourly"
    kind: k
    payload:
      day: 2030-01-01
      ids: [1, 2]
      opts: {dry_run: true, ratio: 0.5, 7: seven, big: 12345678901234}
      none: null
      text: "true"
      anchor: &a {x: 1}
      again: *a
`))
	require.NoError(t, err)
	require.Empty(t, entries[0].Payload, "absent: the scheduler sends {}")
	require.JSONEq(t, `{"day":"2030-01-01","ids":[1,2],"opts":{"dry_run":true,"ratio":0.5,"7":"seven","big":12345678901234},
		"none":null,"text":"true","anchor":{"x":1},"again":{"x":1}}`,
		string(entries[1].Payload))
	require.Nil(t, entries[0].MaxRetry)
	require.Zero(t, entries[0].Timeout)
}
