package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/outbox"
)

// OutboxOptions read the counters of a process's relay and reconciler at
// scrape time. A nil func leaves its metric out.
type OutboxOptions struct {
	// Published: jobs the relay handed to Redis.
	Published func() uint64
	// Republished: jobs the reconciler found missing from Redis and
	// published again (each one is drift repaired: Redis lost data).
	Republished func() uint64
	// TakenOver: jobs no relay took off the outbox in time, published by
	// the reconciler instead (a relay is not running, or falls behind).
	TakenOver func() uint64
	// LeasesReleased: jobs of gone workers (their lease expired) the
	// reconciler's rescuer handed back to the queue.
	LeasesReleased func() uint64
	// Pruned: finished jobs removed after their retention.
	Pruned func() uint64
	// PrunedBatches: completed batches removed once their members were.
	PrunedBatches func() uint64
	// OwedAlerts: deaths whose worker stopped before its OnDead returned,
	// alerted by the reconciler.
	OwedAlerts func() uint64
	// PrunedByKind: jobs pruned per kind and status, dead letters dropped
	// by their kind's bounds as status dead (keel_pruned_jobs_total).
	PrunedByKind func() map[outbox.KindStatus]uint64
	// DeadLettersToDrop: per kind, seen dead letters past the kind's
	// bounds, alerted and dropped once their notice has run
	// (keel_dead_letters_to_drop).
	DeadLettersToDrop func() map[string]int
}

// RegisterOutbox registers the relay's and reconciler's counters on reg.
func RegisterOutbox(reg prometheus.Registerer, o OutboxOptions) error {
	for _, c := range []struct {
		name, help string
		fn         func() uint64
	}{
		{"keel_outbox_published_total", "Jobs the relay published from the ledger to Redis.", o.Published},
		{"keel_reconciler_republished_total", "Jobs found missing from Redis and published again from the ledger.", o.Republished},
		{"keel_reconciler_outbox_taken_over_total", "Jobs no relay took off the outbox in time, published by the reconciler instead.", o.TakenOver},
		{"keel_reconciler_leases_released_total", "Jobs of gone workers (lease expired) that the reconciler's rescuer handed back to the queue.", o.LeasesReleased},
		{"keel_ledger_pruned_total", "Succeeded, discarded and cancelled jobs pruned after their retention.", o.Pruned},
		{"keel_ledger_batches_pruned_total", "Completed batches pruned after their retention, once no member was left.", o.PrunedBatches},
		{"keel_reconciler_owed_alerts_total", "Deaths whose worker stopped before it alerted them, alerted by the reconciler.", o.OwedAlerts},
	} {
		if c.fn == nil {
			continue
		}
		fn := c.fn
		if err := reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: c.name, Help: c.help},
			func() float64 { return float64(fn()) })); err != nil {
			return err
		}
	}
	if o.PrunedByKind != nil || o.DeadLettersToDrop != nil {
		return reg.Register(retentionCollector{o.PrunedByKind, o.DeadLettersToDrop})
	}
	return nil
}

var (
	prunedJobsDesc = prometheus.NewDesc("keel_pruned_jobs_total",
		"Jobs pruned after their kind's retention, by kind and status; dead letters dropped by their kind's bounds count as status dead.",
		[]string{"kind", "status"}, nil)
	deadToDropDesc = prometheus.NewDesc("keel_dead_letters_to_drop",
		"Seen dead letters past their kind's bounds, alerted and dropped once the notice (DeadDropNotice, 24h) has run, by kind.",
		[]string{"kind"}, nil)
)

// retentionCollector reads the reconciler's per-kind prune counts at
// scrape time: their labels are the kinds it met, not known beforehand.
type retentionCollector struct {
	pruned func() map[outbox.KindStatus]uint64
	toDrop func() map[string]int
}

func (c retentionCollector) Describe(ch chan<- *prometheus.Desc) {
	if c.pruned != nil {
		ch <- prunedJobsDesc
	}
	if c.toDrop != nil {
		ch <- deadToDropDesc
	}
}

func (c retentionCollector) Collect(ch chan<- prometheus.Metric) {
	if c.pruned != nil {
		for k, n := range c.pruned() {
			ch <- prometheus.MustNewConstMetric(prunedJobsDesc, prometheus.CounterValue, float64(n), k.Kind, k.Status)
		}
	}
	if c.toDrop != nil {
		for kind, n := range c.toDrop() {
			ch <- prometheus.MustNewConstMetric(deadToDropDesc, prometheus.GaugeValue, float64(n), kind)
		}
	}
}
