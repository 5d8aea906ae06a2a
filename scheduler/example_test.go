package scheduler_test

import (
	"context"
	"fmt"
	"time"

	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

// A scheduler process: run as many as you like on the same entries.
func Example() {
	var client *tasks.Client // tasks.NewClient(tasks.ClientConfig{Redis: ..., Pool: ...})
	var kinds *tasks.Kinds   // tasks.NewKinds(DailyReport, ...): the program's kinds
	s, err := scheduler.New(scheduler.Config{
		Client: client,
		Kinds:  kinds,
		Entries: []scheduler.Entry{{
			Name:    "nightly-report",
			Spec:    "0 2 * * *",
			Kind:    "report:daily",
			Payload: []byte(`{"format":"pdf"}`),
		}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	_ = s.Run(context.Background()) // until the context ends
}

// On 31 March 2030 Berlin's clocks skip from 02:00 to 03:00; the nightly
// entry still runs that night, at 03:00.
func ExampleEntry_Next() {
	berlin, _ := time.LoadLocation("Europe/Berlin")
	e := scheduler.Entry{Name: "nightly-report", Spec: "0 2 * * *", TimeZone: "Europe/Berlin", Kind: "report:daily"}
	t := time.Date(2030, 3, 29, 12, 0, 0, 0, time.UTC)
	for range 3 {
		t, _ = e.Next(t)
		fmt.Println(t.In(berlin).Format("Mon 02 Jan 15:04 MST"), scheduler.TickKey(e.Name, t))
	}
	// Output:
	// Sat 30 Mar 02:00 CET cron:nightly-report:2030-03-30T01:00:00Z
	// Sun 31 Mar 03:00 CEST cron:nightly-report:2030-03-31T01:00:00Z
	// Mon 01 Apr 02:00 CEST cron:nightly-report:2030-04-01T00:00:00Z
}

func ExampleParseFile() {
	entries, err := scheduler.ParseFile("schedule.yaml", []byte(`
entries:
  - name: nightly-report
    spec: "0 2 * * *"
    kind: report:daily
    payload: {format: pdf}
`))
	fmt.Println(entries[0].Name, entries[0].Spec, entries[0].Kind, string(entries[0].Payload), err)

	_, err = scheduler.ParseFile("schedule.yaml", []byte(`
entries:
  - name: nightly-report
    spec: "* * *"
    kind: report:daily
`))
	fmt.Println(err)
	// Output:
	// nightly-report 0 2 * * * report:daily {"format":"pdf"} <nil>
	// schedule.yaml:4: schedule entry "nightly-report": bad spec "* * *": expected 5 to 6 fields, found 3: [* * *]
}
