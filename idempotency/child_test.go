package idempotency_test

func runWorkerChild() bool { return false }
