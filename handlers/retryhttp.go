package handlers

import (
	"net/http"

	"github.com/keeljobs/keel/retry"
)

// retryFromResponse turns a mail API answer into keel's error classes:
// 429 and 5xx retry (honouring Retry-After), other 4xx are permanent.
func retryFromResponse(resp *http.Response) error { return retry.FromResponse(resp) }
