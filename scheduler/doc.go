// Package scheduler runs cron entries through keel's ledger, deduplicated
// across any number of scheduler instances: each tick of an entry becomes
// exactly one job, however many instances run and however often they restart.
//
// # How ticks stay single
//
// Every instance enqueues every tick of every entry, with tasks.Client.Enqueue
// and the business key TickKey(name, tick) = cron:<name>:<tick, UTC RFC 3339>.
// The ledger holds one job per (kind, business key), so the first enqueue of a
// tick creates its job and the others get that job back (Stats.Existed). No
// lock, no leader: an instance that dies loses nothing while another runs, and
// one that restarts re-enqueues nothing that exists.
//
// # Missed ticks
//
// Table keel_schedule (ledger migration 0003) remembers the newest tick handled
// per entry. A scheduler starting after every instance was down reads it to
// find the ticks missed meanwhile; ticks overtaken by the entry's next tick
// while the ledger could not be written are missed too. Config.MissedTicks
// decides: CatchUp (the default) enqueues the Config.MaxCatchUp (default 1)
// most recent missed ticks of each entry, late, oldest first, and drops older
// ones; Skip drops them all. The table is a hint: when it is stale, the ticks
// caught up again already have jobs and are not run twice.
//
// An entry new to the fleet starts with its first tick after the scheduler
// takes it on; from then on its downtime counts, even before its first tick.
// A reload that changes an entry's spec or time zone starts it afresh, without
// missed ticks. Rows of entries removed from the schedule stay: an entry added
// back under the same name is caught up as after downtime (a run-time entry's
// row goes with it, so one added again starts afresh).
//
// # Run-time entries and pauses
//
// Besides its own entries (Config.Entries or Config.File), every scheduler
// runs those a person added in the ledger (inspect.AddSchedule, keel schedule
// add; table keel_schedule_entries, migration 0027), and skips the entries
// paused there, whatever defines them. It reads both every Config.Poll (2 s)
// and at start, before its first tick; Refresh reads at once. A paused
// entry's ticks are recorded in keel_schedule as handled without a job, so a
// resume starts at the next tick and nothing paused is caught up. A run-time
// entry whose name one of the scheduler's own has is not run: the file or
// code wins. The scheduler records in keel_schedule what each entry it runs
// is (spec, zone, kind), for the operator's view (inspect.Schedules).
//
// # Schedule file
//
// keel scheduler --config FILE reads entries from YAML (LoadFile):
//
//	entries:
//	  - name: nightly-report      # unique; part of each tick's business key
//	    spec: "0 2 * * *"         # cron spec, quoted (see below)
//	    timezone: Europe/Berlin   # IANA zone the spec is read in; default UTC
//	    kind: report:daily        # task kind to enqueue
//	    payload:                  # YAML mapping, enqueued as the JSON payload; default {}
//	      format: pdf
//	    queue: low                # default: the kind's queue
//	    max_retry: 3              # default: keel's retry budget for a task
//	    timeout: 5m               # one attempt's limit, a Go duration
//
// Only name, spec and kind are required; any other key is an error. A spec has
// 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds
// first, or is a descriptor: @yearly, @monthly, @weekly, @daily, @hourly or
// @every <duration> (whole seconds; ticks at multiples of the duration since
// the Unix epoch, so all instances agree). Quote specs: YAML reads a leading *
// or @ as its own syntax. A spec is read on the local clock of its timezone;
// across daylight-saving changes each local time ticks once (see
// Entry.TimeZone).
//
// A running scheduler reloads the file when its modification time or size
// change (checked every 2 s) and on Reload (SIGHUP for keel scheduler). A file
// that does not load, or names an unknown kind, is logged and the running
// entries stay. Replace the file atomically (write a copy, rename it over) so
// a check never reads it half-written.
//
// Errors name the file, line, entry and field:
//
//	schedule.yaml:7: schedule entry "nightly-report": bad spec "* * *": expected 5 to 6 fields, found 3: [* * *]
package scheduler
