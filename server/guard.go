package server

import "github.com/keeljobs/keel/internal/executor"

// GuardConfig configures the ledger guard every delivery passes: leases,
// completion rounds, timeouts, and the hooks for deaths, expiries and
// cancellations (Config.Guard; zero values take the defaults below).
type GuardConfig = executor.GuardConfig

// GuardStats counts what a worker's guard did to runs (Server.GuardStats,
// metrics.WorkerConfig.Guard).
type GuardStats = executor.GuardStats

// The guard's defaults.
const (
	DefaultLease        = executor.DefaultLease
	DefaultLedgerRetry  = executor.DefaultLedgerRetry
	DefaultBatchSize    = executor.DefaultBatchSize
	DefaultBatchLoops   = executor.DefaultBatchLoops
	DefaultTimeoutGrace = executor.DefaultTimeoutGrace
	DefaultMaxWait      = executor.DefaultMaxWait
	// DefaultProgressInterval is the least time between two writes of one
	// run's progress (GuardConfig.ProgressInterval).
	DefaultProgressInterval = executor.DefaultProgressInterval
)
