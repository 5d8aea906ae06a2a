package web_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A job that has not ended can be followed live: its page reloads itself
// (?refresh=) until the job ends, and says how to stop; an ended job's
// page never reloads, nor does an unknown period.
func TestJobPageFollowsAJobLive(t *testing.T) {
	b := setup(t, nil)
	v := b.signIn(t, viewerName, viewerPassword)
	j := b.waitingJob(t, "order:1")
	_, err := b.pool.Exec(t.Context(), `UPDATE keel_jobs SET status = 'running', lease_holder = 'w', lease_until = now() + interval '1 minute', attempts = 1 WHERE id = $1`, j.ID)
	require.NoError(t, err)

	page := v.get(t, "/jobs/"+j.ID)
	require.Contains(t, page.body, `id="follow" href="/jobs/`+j.ID+`?refresh=5"`)
	require.NotContains(t, page.body, `http-equiv="refresh"`)
	page = v.get(t, "/jobs/"+j.ID+"?refresh=5")
	require.Contains(t, page.body, `<meta http-equiv="refresh" content="5">`)
	require.Contains(t, page.body, `id="live"`)
	page = v.get(t, "/jobs/"+j.ID+"?refresh=7")
	require.NotContains(t, page.body, `http-equiv="refresh"`, "not one of the periods offered")

	dead := b.deadJob(t, "order:send_receipt", "order:2", "boom")
	page = v.get(t, "/jobs/"+dead.ID+"?refresh=5")
	require.NotContains(t, page.body, `http-equiv="refresh"`, "an ended job does not change by itself")
	require.NotContains(t, page.body, `id="follow"`)
}
