// Package scaleout holds keel's tests against Redis Cluster and Redis
// Sentinel: workers, relays and schedulers must keep the ledger's
// invariants when Redis is not a single server.
package scaleout
