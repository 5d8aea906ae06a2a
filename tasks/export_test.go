package tasks

// QueuedEnqueues is how many Enqueue calls wait for the group commit.
func QueuedEnqueues(c *Client) int { return len(c.inserts.in) }

// InsertLoops is how many group-commit statements may run at once.
const InsertLoops = insertLoops
