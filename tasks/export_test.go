package tasks

// QueuedEnqueues is how many Enqueue calls wait for the group commit.
func QueuedEnqueues(c *Client) int { return len(c.inserts.in) }
