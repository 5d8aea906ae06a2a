// Package retry decides what a failed job means: it classifies errors as
// permanent, transient, unknown or a wait, computes capped and jittered
// backoff that honours a server's Retry-After, and translates the outcome
// into asynq's terms (SkipRetry, RetryDelayFunc, IsFailure) in one
// middleware, so that no failure is retried blindly or forever.
package retry
