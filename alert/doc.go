// Package alert tells people when a job dies. Wired as the ledger guard's
// OnDead hook, an Alerter logs each death at Error level, counts it in
// keel_jobs_dead_total{kind,queue,class}, and sends a webhook per window:
// one death as a JSON event, a burst as one summary, with bounded retries.
// It never makes the worker wait for the webhook.
package alert
