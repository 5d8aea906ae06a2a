package tasks

// QueuedEnqueues is how many Enqueue calls wait for the group commit.
func QueuedEnqueues(c *Client) int { return c.inserts.Queued() }

// InsertLoops is how many group-commit statements may run at once.
const InsertLoops = insertLoops
