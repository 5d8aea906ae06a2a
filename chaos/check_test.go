package chaos_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

// report is the outcome of the final check.
type report struct {
	table    string
	failures []string
}

type jobRow struct {
	id, kind, key, status string
	attempts              int
	lastErr, errClass     string
	waitedMS              int64
}

// kindStats is one line of the table.
type kindStats struct {
	accepted, dupSubmits, succeeded, dead, discarded, inDoubt, open, lost, effects, calls, maxAttempts int
}

// invariant is one assertion of the check: its count must be zero.
type invariant struct {
	name     string
	n        int
	examples []string
}

type invariants struct {
	list []*invariant
	by   map[string]*invariant
}

func newInvariants(names ...string) *invariants {
	v := &invariants{by: map[string]*invariant{}}
	for _, n := range names {
		inv := &invariant{name: n}
		v.list = append(v.list, inv)
		v.by[n] = inv
	}
	return v
}

func (v *invariants) fail(name, example string) {
	inv := v.by[name]
	inv.n++
	if len(inv.examples) < 5 {
		inv.examples = append(inv.examples, example)
	}
}

const (
	invLost         = "jobs lost (accepted, not ended: succeeded, dead or expired)"
	invDupEffect    = "local effects duplicated"
	invDupCall      = "external calls duplicated (per step key)"
	invWrongState   = "jobs ended in a state their kind does not predict"
	invNoReason     = "dead jobs without last_error or error_class"
	invEffect       = "succeeded without its effect, or effect without success"
	invCall         = "succeeded external jobs without exactly one call"
	invDupSubmit    = "duplicate submissions not resolved to one job"
	invOrphan       = "EnqueueTx business rows and jobs that disagree"
	invWaitAttempts = "rate-limited jobs whose waits counted as attempts"
	invTickMissing  = "cron ticks without a job"
	invTickBad      = "cron tick jobs not succeeded once"
	invPoison       = "poison jobs not retired dead (crashed) within their budget"
	invHung         = "hung jobs not ended by their budget"
	invLate         = "given-up runs whose late Step or InTx was not refused"
	invDeployDead   = "MaxRetry(0) jobs dead from a deploy"
	invDeadline     = "deadline jobs run past their deadline, or enqueues past it not refused"
	invUnique       = "Unique keys whose runs overlapped, or whose second job was not new"
	invAlert        = "alerts for jobs that did not die, or deadline deaths without one"
	invExercised    = "faults planned but never exercised"
)

// check reads the final state and tests every invariant.
func (d *driver) check(ctx context.Context) report {
	t := d.t
	q := func(sql string, scan func(pgx.Rows) error) {
		rows, err := d.pool.Query(ctx, sql)
		if err != nil {
			t.Fatalf("check: %v", err)
		}
		defer rows.Close()
		for rows.Next() {
			if err := scan(rows); err != nil {
				t.Fatalf("check: %v", err)
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("check: %v", err)
		}
	}
	jobs := map[string]jobRow{} // by business key
	byID := map[string]jobRow{} // every row, by id
	var ticks []jobRow
	q(`SELECT id, kind, business_key, status, attempts, coalesce(last_error, ''), coalesce(error_class, ''), waited_ms
		FROM keel_jobs WHERE kind LIKE 'chaos:%'`, func(r pgx.Rows) error {
		var j jobRow
		if err := r.Scan(&j.id, &j.kind, &j.key, &j.status, &j.attempts, &j.lastErr, &j.errClass, &j.waitedMS); err != nil {
			return err
		}
		byID[j.id] = j
		if j.kind == tickKind.Name() {
			ticks = append(ticks, j)
		} else {
			jobs[j.key] = j
		}
		return nil
	})
	effects := map[string]int{}
	q(`SELECT business_key, count(*) FROM chaos_effects GROUP BY 1`, func(r pgx.Rows) error {
		var k string
		var n int
		err := r.Scan(&k, &n)
		effects[k] = n
		return err
	})
	callsByStep := map[string]int{}
	callsByKey := map[string]int{}
	q(`SELECT step_key, business_key, count(*) FROM chaos_external_calls GROUP BY 1, 2`, func(r pgx.Rows) error {
		var s, k string
		var n int
		err := r.Scan(&s, &k, &n)
		callsByStep[s] += n
		callsByKey[k] += n
		return err
	})
	stepStatus := map[string]string{} // by job id
	q(`SELECT job_id, status FROM keel_steps WHERE name = '`+stepName+`'`, func(r pgx.Rows) error {
		var id, s string
		err := r.Scan(&id, &s)
		stepStatus[id] = s
		return err
	})
	waits := map[string][]int32{} // attempt seen by each run of a rate-limited job
	q(`SELECT business_key, attempts FROM chaos_waits`, func(r pgx.Rows) error {
		var k string
		var a []int32
		err := r.Scan(&k, &a)
		waits[k] = a
		return err
	})
	runs := map[string]int{} // runs of the rare kinds' handlers
	q(`SELECT business_key, count(*) FROM chaos_runs GROUP BY 1`, func(r pgx.Rows) error {
		var k string
		var n int
		err := r.Scan(&k, &n)
		runs[k] = n
		return err
	})
	type lateRun struct {
		key            string
		attempt        int
		givenUp        bool
		stepErr, txErr string
	}
	var lates []lateRun
	q(`SELECT business_key, attempt, given_up, step_err, tx_err FROM chaos_late`, func(r pgx.Rows) error {
		var l lateRun
		err := r.Scan(&l.key, &l.attempt, &l.givenUp, &l.stepErr, &l.txErr)
		lates = append(lates, l)
		return err
	})
	type deadlineRun struct{ due, started time.Time }
	deadlineRuns := map[string][]deadlineRun{}
	q(`SELECT business_key, due, started FROM chaos_deadline_runs`, func(r pgx.Rows) error {
		var k string
		var dr deadlineRun
		err := r.Scan(&k, &dr.due, &dr.started)
		deadlineRuns[k] = append(deadlineRuns[k], dr)
		return err
	})
	callWaits := map[string]int{} // late-call runs that waited for a call in flight
	q(`SELECT business_key, count(*) FROM chaos_call_waits WHERE waited GROUP BY 1`, func(r pgx.Rows) error {
		var k string
		var n int
		err := r.Scan(&k, &n)
		callWaits[k] = n
		return err
	})
	keyRuns := map[string][]keyRun{} // a Unique kind's runs, by key, in start order
	q(`SELECT business_key, job_id, gen, started_at, ended_at FROM chaos_key_runs ORDER BY started_at`, func(r pgx.Rows) error {
		var k string
		var kr keyRun
		err := r.Scan(&k, &kr.job, &kr.gen, &kr.start, &kr.ended)
		keyRuns[k] = append(keyRuns[k], kr)
		return err
	})
	cuts := map[string]int{} // deploy-committed runs cut short after their commit
	q(`SELECT business_key, count(*) FROM chaos_cut GROUP BY 1`, func(r pgx.Rows) error {
		var k string
		var n int
		err := r.Scan(&k, &n)
		cuts[k] = n
		return err
	})
	alerts := map[string]int{} // by job id
	q(`SELECT job_id, count(*) FROM chaos_alerts GROUP BY 1`, func(r pgx.Rows) error {
		var id string
		var n int
		err := r.Scan(&id, &n)
		alerts[id] = n
		return err
	})
	svc := d.service.stats()
	orders := map[string]bool{}
	q(`SELECT business_key FROM chaos_orders`, func(r pgx.Rows) error {
		var k string
		err := r.Scan(&k)
		orders[k] = true
		return err
	})

	inv := newInvariants(invLost, invDupEffect, invDupCall, invWrongState, invNoReason, invEffect, invCall,
		invDupSubmit, invOrphan, invWaitAttempts, invTickMissing, invTickBad,
		invPoison, invHung, invLate, invDeployDead, invDeadline, invUnique, invAlert, invExercised)
	q(`SELECT business_key, kind, err FROM chaos_violations`, func(r pgx.Rows) error {
		var k, kind, e string
		err := r.Scan(&k, &kind, &e)
		inv.fail(invDupEffect, fmt.Sprintf("%s (%s): %s", k, kind, e))
		return err
	})
	for step, n := range callsByStep {
		if n > 1 {
			inv.fail(invDupCall, fmt.Sprintf("step %s called %d times", step, n))
		}
	}
	// The fake service applied every call it received: a key it counted
	// twice is a charge made twice.
	for step, n := range svc.byStep {
		if n > 1 {
			inv.fail(invDupCall, fmt.Sprintf("fake service charged step %s %d times", step, n))
		}
	}
	// A hung run keel gave up must be refused whatever it tries later.
	refused := func(e string) bool {
		return strings.Contains(e, idempotency.ErrRunGivenUp.Error()) || strings.Contains(e, idempotency.ErrLeaseLost.Error())
	}
	for _, l := range lates {
		switch {
		case !l.givenUp:
			inv.fail(invLate, fmt.Sprintf("%s attempt %d: never given up (a minute past its deadline)", l.key, l.attempt))
		case !refused(l.stepErr) || !refused(l.txErr):
			inv.fail(invLate, fmt.Sprintf("%s attempt %d: late step: %q, late InTx: %q", l.key, l.attempt, l.stepErr, l.txErr))
		}
	}

	for id, n := range alerts {
		if j, ok := byID[id]; !ok || j.status != "dead" {
			inv.fail(invAlert, fmt.Sprintf("job %s (%s %s): %s (%s), alerted %d times", id, j.kind, j.key, j.status, j.errClass, n))
		}
	}
	for _, j := range byID {
		if strings.HasSuffix(j.key, refusedSuffix) {
			inv.fail(invDeadline, fmt.Sprintf("%s: an enqueue past its deadline made job %s", j.key, j.id))
		}
	}
	for _, w := range d.pastDeadlineWrong {
		inv.fail(invDeadline, "an enqueue past its deadline was not refused with ErrPastDeadline: "+w)
	}

	stats := map[*class]*kindStats{}
	for _, c := range allClasses {
		stats[c] = &kindStats{}
	}
	var submits, tries, unaccepted, deployResumed, crashed, hungTimedOut int
	var ex exercised
	d.mu.Lock()
	keys := make([]string, 0, len(d.keys))
	for k := range d.keys {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, key := range keys {
		rec := d.keys[key]
		submits += rec.submits
		tries += rec.submits + rec.errors
		if !rec.accepted {
			// Never accepted (the run ended first): no promise was made.
			unaccepted++
			continue
		}
		c, st := rec.class, stats[rec.class]
		st.accepted++
		if rec.planned > 1 {
			st.dupSubmits++
		}
		row, ok := jobs[key]
		switch {
		case len(rec.jobIDs) != 1, rec.created > 1, rec.created == 0 && rec.errors == 0, ok && !rec.jobIDs[row.id]:
			inv.fail(invDupSubmit, fmt.Sprintf("%s: %d submissions created %d jobs, ids %v, ledger %q (failed tries %d, last: %s)",
				key, rec.submits, rec.created, rec.jobIDs, row.id, rec.errors, rec.lastErr))
		}
		if rec.viaTx && !orders[key] {
			inv.fail(invOrphan, key+": job accepted through EnqueueTx but its business row is missing")
		}
		if !ok {
			st.lost++
			inv.fail(invLost, key+": no ledger row")
			continue
		}
		st.maxAttempts = max(st.maxAttempts, row.attempts)
		inDoubt := false
		switch row.status {
		case "succeeded":
			st.succeeded++
			if c.want != idempotency.StatusSucceeded {
				inv.fail(invWrongState, fmt.Sprintf("%s (%s): succeeded, want %s", key, c.name, c.want))
			}
		case "dead":
			st.dead++
			if row.lastErr == "" || row.errClass == "" {
				inv.fail(invNoReason, fmt.Sprintf("%s: last_error %q, error_class %q", key, row.lastErr, row.errClass))
			}
			inDoubt = strings.Contains(row.lastErr, idempotency.ErrInDoubt.Error())
			switch {
			case inDoubt && c.inDoubtOK:
				st.inDoubt++
				if stepStatus[row.id] != "started" {
					inv.fail(invWrongState, fmt.Sprintf("%s: dead in doubt but its step is %q", key, stepStatus[row.id]))
				}
			case c.crashOK && row.errClass == string(retry.ClassCrashed):
				// Its last run was killed: a crash counts, a deploy does not.
				crashed++
			case c.want != idempotency.StatusDead, c.deadClass != "" && row.errClass != c.deadClass:
				inv.fail(invWrongState, fmt.Sprintf("%s (%s): dead (%s: %s), want %s %s", key, c.name, row.errClass, firstLine(row.lastErr), c.want, c.deadClass))
			}
		case "discarded":
			st.discarded++
			if c.want != idempotency.StatusDiscarded || (c.deadClass != "" && row.errClass != c.deadClass) {
				inv.fail(invWrongState, fmt.Sprintf("%s (%s): discarded (%s: %s), want %s %s", key, c.name, row.errClass, firstLine(row.lastErr), c.want, c.deadClass))
			}
		default:
			st.open++
			st.lost++
			inv.fail(invLost, fmt.Sprintf("%s: still %s after %d attempts (%s)", key, row.status, row.attempts, firstLine(row.lastErr)))
		}
		e := effects[key]
		st.effects += e
		switch {
		case e > 1:
			inv.fail(invDupEffect, fmt.Sprintf("%s: %d effects", key, e))
		case (row.status == "succeeded") != (e == 1):
			inv.fail(invEffect, fmt.Sprintf("%s: %s with %d effects", key, row.status, e))
		}
		switch c {
		case poisonClass:
			if row.status != "dead" || row.errClass != string(retry.ClassCrashed) || runs[key] > poisonMaxRetry+1 {
				inv.fail(invPoison, fmt.Sprintf("%s: %s (%s) after %d runs, %d attempts, budget %d runs: %s",
					key, row.status, row.errClass, runs[key], row.attempts, poisonMaxRetry+1, firstLine(row.lastErr)))
			}
		case hungClass, hungOnceClass:
			ended := row.status == string(c.want) && (c.deadClass == "" || row.errClass == c.deadClass)
			if c.deadClass != "" && ended {
				hungTimedOut++
			}
			if !ended && (!c.crashOK || row.errClass != string(retry.ClassCrashed)) {
				inv.fail(invHung, fmt.Sprintf("%s (%s): %s (%s) after %d attempts: %s", key, c.name, row.status, row.errClass, row.attempts, firstLine(row.lastErr)))
			}
			if n := callsByKey[key]; n > 0 {
				inv.fail(invLate, fmt.Sprintf("%s: a given-up run made its external call (%d)", key, n))
			}
		case deadlineClass, expiringClass:
			for _, r := range deadlineRuns[key] {
				if !r.started.Before(r.due) {
					inv.fail(invDeadline, fmt.Sprintf("%s: a run started %s after its deadline %s", key, r.started.Sub(r.due), r.due.Format(time.StampMilli)))
				}
			}
			if len(deadlineRuns[key]) == 0 {
				ex.deadlineUnrun++
			} else {
				ex.deadlineRan++
			}
			if c == deadlineClass && row.status == "dead" && alerts[row.id] == 0 {
				inv.fail(invAlert, fmt.Sprintf("%s: dead (%s) without an alert", key, row.errClass))
			}
		case lateCallClass:
			if callWaits[key] > 0 && row.status == "succeeded" {
				ex.callWaited++
			}
		case uniqueCancel, uniqueTimeout:
			d.checkUnique(inv, &ex, key, rec, byID, keyRuns[key])
		case committedClass:
			if row.status == "dead" && row.errClass != string(retry.ClassCrashed) {
				inv.fail(invDeployDead, fmt.Sprintf("%s: dead (%s) after %d runs: %s", key, row.errClass, runs[key], firstLine(row.lastErr)))
			}
			if cuts[key] > 0 && row.status == "succeeded" && alerts[row.id] == 0 {
				ex.cutAfterCommit++
			}
		case crashOnceClass:
			if row.status == "succeeded" && runs[key] > 1 {
				ex.crashedThenAlone++
				if row.waitedMS > 0 {
					ex.handedBack++
				}
			}
		case deployClass:
			if row.status == "dead" && row.errClass != string(retry.ClassCrashed) {
				inv.fail(invDeployDead, fmt.Sprintf("%s: dead (%s) after %d runs: %s", key, row.errClass, runs[key], firstLine(row.lastErr)))
			}
			// More runs than attempts: a deploy cut it short and it went on
			// without paying for it.
			if row.status == "succeeded" && runs[key] > row.attempts {
				deployResumed++
			}
		}
		if c.external {
			n := callsByKey[key]
			if c.service {
				n = svc.byOrder[key]
			}
			st.calls += n
			switch {
			case n > 1:
				inv.fail(invDupCall, fmt.Sprintf("%s: %d calls", key, n))
			case row.status == "succeeded" && n != 1:
				inv.fail(invCall, fmt.Sprintf("%s: succeeded with %d calls", key, n))
			}
		}
		if c.kind == limitedKind && row.status == "succeeded" {
			// Without waits counting, consecutive runs see the same attempt
			// unless a crash came between; an attempt that went up at every
			// run is the mark of waits counted as failures.
			seen := waits[key]
			rising := len(seen) > limitedWaits
			for i := 1; i < len(seen); i++ {
				rising = rising && seen[i] > seen[i-1]
			}
			if rising || len(seen) <= limitedWaits {
				inv.fail(invWaitAttempts, fmt.Sprintf("%s: runs saw attempts %v (%d waits expected)", key, seen, limitedWaits))
			}
		}
	}
	d.mu.Unlock()
	d.checkExercised(inv, stats, svc, len(lates), deployResumed, hungTimedOut)
	d.checkJointsExercised(inv, stats, ex)
	for k := range orders {
		if _, ok := jobs[k]; !ok {
			inv.fail(invOrphan, k+": business row committed without its job")
		}
	}

	tickStats := d.checkTicks(ticks, effects, inv)

	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 2, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "kind\tclass\taccepted\tsubmitted twice\tsucceeded\tdead\texpired\tin doubt\tnot terminal\teffects\text. calls\tmax attempts\t")
	total := kindStats{}
	row := func(kind, name string, s kindStats) {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", kind, name, s.accepted, s.dupSubmits, s.succeeded,
			s.dead, s.discarded, s.inDoubt, s.open, s.effects, s.calls, s.maxAttempts)
	}
	for _, c := range allClasses {
		s := *stats[c]
		row(c.kind.Name(), c.name, s)
		total.accepted += s.accepted
		total.dupSubmits += s.dupSubmits
		total.succeeded += s.succeeded
		total.dead += s.dead
		total.discarded += s.discarded
		total.inDoubt += s.inDoubt
		total.open += s.open
		total.effects += s.effects
		total.calls += s.calls
		total.maxAttempts = max(total.maxAttempts, s.maxAttempts)
	}
	row(tickKind.Name(), "cron @every 1s", tickStats)
	row("total", "", total)
	tw.Flush()
	fmt.Fprintf(&b, "\nsubmissions accepted %d (tries %d; keys never accepted %d)\n", submits, tries, unaccepted)
	fmt.Fprintf(&b, "workers killed by poison jobs %d; hung runs given up and refused later %d; "+
		"deploy jobs cut short by SIGTERM and finished without using an attempt %d; "+
		"deploy and hung jobs whose last run a kill cut short (dead, crashed) %d\n",
		d.poisonExits.Load(), len(lates), deployResumed, crashed)
	fmt.Fprintf(&b, "fake service: charges answered never %d, too late %d, refused unapplied %d; Verify look-ups %d, of which found nothing %d\n",
		svc.dropped, svc.late, svc.refused, svc.checks, svc.absent)
	fmt.Fprintf(&b, "deadline jobs ended without a run %d, after a run that asked for a retry past the deadline %d; enqueues past the deadline refused %d of %d\n",
		ex.deadlineUnrun, ex.deadlineRan, d.pastDeadlineRefused, d.pastDeadlineTries)
	fmt.Fprintf(&b, "late step calls received %d; late-call jobs whose next run waited for the call in flight %d\n", svc.lateCalls, ex.callWaited)
	fmt.Fprintf(&b, "Unique keys whose second job was accepted while the first job's handler still acted %d (runs of a key never overlapping: see invariant)\n", ex.uniqueHeld)
	fmt.Fprintf(&b, "deploy-committed jobs cut short after their commit, succeeded without an alert %d\n", ex.cutAfterCommit)
	fmt.Fprintf(&b, "crash-once jobs that crashed their worker and then succeeded alone %d, of which handed back while they waited for room %d\n\n",
		ex.crashedThenAlone, ex.handedBack)

	tw = tabwriter.NewWriter(&b, 2, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "invariant\tcount\tverdict")
	var failures []string
	for _, v := range inv.list {
		verdict := "ok"
		if v.n > 0 {
			verdict = "FAIL"
			failures = append(failures, fmt.Sprintf("%s: %d, e.g.\n  %s", v.name, v.n, strings.Join(v.examples, "\n  ")))
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", v.name, v.n, verdict)
	}
	fmt.Fprintf(tw, "%s\t%d\t%s\n", "in doubt, parked for a person (allowed, unverified external only)", total.inDoubt, "info")
	tw.Flush()
	return report{table: b.String(), failures: failures}
}

// checkExercised fails the run when a fault it planned never happened, so
// that the invariants about it could not have failed.
func (d *driver) checkExercised(inv *invariants, stats map[*class]*kindStats, svc serviceStats, lates, deployResumed, hungTimedOut int) {
	if stats[poisonClass].accepted > 0 && d.poisonExits.Load() == 0 {
		inv.fail(invExercised, "no poison job killed a worker")
	}
	if stats[hungClass].accepted > 0 && (lates == 0 || hungTimedOut == 0) {
		inv.fail(invExercised, fmt.Sprintf("hung runs given up and tried to finish late: %d, always-hung jobs dead by timeout: %d", lates, hungTimedOut))
	}
	if stats[deployClass].accepted > 0 && len(d.cfg.Deploys) > 0 && deployResumed == 0 {
		inv.fail(invExercised, "no deploy cut a job short")
	}
	if stats[classByKind(rawKind)].accepted > 0 {
		if svc.dropped+svc.late == 0 {
			inv.fail(invExercised, "the fake service applied no charge without answering it")
		}
		if svc.absent == 0 {
			inv.fail(invExercised, "no Verify found a charge missing")
		}
	}
}

// exercised counts what the joints' faults did, for the report and for
// checkJointsExercised.
type exercised struct {
	deadlineUnrun, deadlineRan int // deadline jobs that ended without a run / after one
	callWaited                 int // late-call jobs that waited for a call in flight, then succeeded
	uniqueHeld                 int // Unique keys whose second job came while the first's handler acted
	cutAfterCommit             int // deploy-committed jobs cut short after their commit, succeeded
	crashedThenAlone           int // crash-once jobs that crashed their worker, then succeeded
	handedBack                 int // of which waited (handed back) for room to run alone
}

// checkJointsExercised fails the run when a joint's fault never happened.
func (d *driver) checkJointsExercised(inv *invariants, stats map[*class]*kindStats, ex exercised) {
	if stats[deadlineClass].accepted+stats[expiringClass].accepted > 0 && (ex.deadlineUnrun == 0 || ex.deadlineRan == 0) {
		inv.fail(invExercised, fmt.Sprintf("deadline jobs ended without a run %d, after a run %d: want both", ex.deadlineUnrun, ex.deadlineRan))
	}
	if d.pastDeadlineTries == 0 && stats[deadlineClass].accepted > 0 {
		inv.fail(invExercised, "no enqueue past a deadline was tried")
	}
	if stats[lateCallClass].accepted > 0 && ex.callWaited == 0 {
		inv.fail(invExercised, "no late-call job's run waited for an earlier run's call in flight")
	}
	if stats[uniqueCancel].accepted+stats[uniqueTimeout].accepted > 0 && ex.uniqueHeld == 0 {
		inv.fail(invExercised, "no Unique key's second job came while its first job's handler still acted")
	}
	if stats[committedClass].accepted > 0 && len(d.cfg.Deploys) > 0 && ex.cutAfterCommit == 0 {
		inv.fail(invExercised, "no deploy cut a job short after its completing InTx")
	}
	if stats[crashOnceClass].accepted > 0 && ex.crashedThenAlone == 0 {
		inv.fail(invExercised, "no crash-once job crashed its worker and then succeeded")
	}
}

// checkUnique checks one key of a Unique scenario: its first job ended as
// its class says (cancelled, or dead at its timeout; crashed if a kill cut
// it), the enqueue after it made a new job, and no two runs of the key
// overlapped — none started before the one before it was last seen acting.
func (d *driver) checkUnique(inv *invariants, ex *exercised, key string, rec *keyRecord, byID map[string]jobRow, runs []keyRun) {
	if rec.scenarioErr != "" || rec.firstID == "" {
		inv.fail(invUnique, fmt.Sprintf("%s: the scenario did not play out: %s", key, rec.scenarioErr))
		return
	}
	first, ok := byID[rec.firstID]
	want, wantClass := "cancelled", ""
	if rec.class == uniqueTimeout {
		want, wantClass = "dead", string(retry.ClassTimeout)
	}
	switch {
	case !ok:
		inv.fail(invUnique, fmt.Sprintf("%s: its first job %s has no row", key, rec.firstID))
	case first.status == "dead" && first.errClass == string(retry.ClassCrashed):
		// A kill cut its only run (MaxRetry 0) and its extra run short.
	case first.status != want || (wantClass != "" && first.errClass != wantClass):
		inv.fail(invUnique, fmt.Sprintf("%s: its first job %s is %s (%s: %s), want %s %s", key, rec.firstID,
			first.status, first.errClass, firstLine(first.lastErr), want, wantClass))
	}
	if rec.nextExisted {
		inv.fail(invUnique, fmt.Sprintf("%s: the enqueue after the window returned the first job", key))
	}
	var firstEnd time.Time
	for i, r := range runs {
		if r.job == rec.firstID && r.ended.After(firstEnd) {
			firstEnd = r.ended
		}
		for _, o := range runs[:i] {
			if r.start.Before(o.ended) {
				inv.fail(invUnique, fmt.Sprintf("%s: a run of job %s (gen %d) started at %s, %s before a run of job %s (gen %d) was last seen acting",
					key, r.job, r.gen, r.start.Format(time.StampMilli), o.ended.Sub(r.start), o.job, o.gen))
			}
		}
	}
	if !firstEnd.IsZero() && rec.nextAt.Before(firstEnd) {
		ex.uniqueHeld++
	}
}

// keyRun is one run of a Unique kind's handler (chaos_key_runs).
type keyRun struct {
	job          string
	gen          int
	start, ended time.Time
}

func classByKind(k *tasks.Kind[order]) *class {
	for _, c := range allClasses {
		if c.kind == k {
			return c
		}
	}
	return nil
}

// checkTicks asserts one succeeded job per tick of the scheduler's entry,
// from its start to its stop, none missing.
func (d *driver) checkTicks(ticks []jobRow, effects map[string]int, inv *invariants) kindStats {
	var st kindStats
	var zero time.Time
	prefix := strings.TrimSuffix(scheduler.TickKey(tickEntry, zero), zero.Format(time.RFC3339))
	var at []time.Time
	for _, j := range ticks {
		st.accepted++
		st.maxAttempts = max(st.maxAttempts, j.attempts)
		st.effects += effects[j.key]
		switch j.status {
		case "succeeded":
			st.succeeded++
		case "dead":
			st.dead++
		default:
			st.open++
		}
		if j.status != "succeeded" || effects[j.key] != 1 {
			inv.fail(invTickBad, fmt.Sprintf("%s: %s with %d effects (%s)", j.key, j.status, effects[j.key], firstLine(j.lastErr)))
		}
		tick, err := time.Parse(time.RFC3339, strings.TrimPrefix(j.key, prefix))
		if err != nil || !strings.HasPrefix(j.key, prefix) {
			inv.fail(invTickBad, fmt.Sprintf("%s: not a tick key of %s", j.key, tickEntry))
			continue
		}
		at = append(at, tick)
	}
	if len(at) == 0 {
		inv.fail(invTickMissing, "the scheduler made no job at all")
		return st
	}
	sort.Slice(at, func(i, j int) bool { return at[i].Before(at[j]) })
	// A tick is due once a second; the ends may be a little late under load.
	const slack = 5 * time.Second
	if gap := at[0].Sub(d.schedStart); gap > time.Second+slack {
		inv.fail(invTickMissing, fmt.Sprintf("first tick %s is %s after the scheduler started", at[0].Format(time.TimeOnly), gap))
	}
	if gap := d.schedStop.Sub(at[len(at)-1]); gap > time.Second+slack {
		inv.fail(invTickMissing, fmt.Sprintf("last tick %s is %s before the scheduler stopped", at[len(at)-1].Format(time.TimeOnly), gap))
	}
	for i := 1; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap != time.Second {
			inv.fail(invTickMissing, fmt.Sprintf("ticks %s and %s are %s apart", at[i-1].Format(time.TimeOnly), at[i].Format(time.TimeOnly), gap))
		}
	}
	return st
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return s
}
