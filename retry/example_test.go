package retry_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/keeljobs/keel/retry"
)

func Example() {
	// A handler marks what it knows.
	declined := retry.Permanent(errors.New("card declined"))
	fmt.Println(retry.Classify(declined))

	// A response says it by its status and Retry-After: a 429 with one is a
	// wait, which uses up no attempt.
	u, _ := url.Parse("https://api.example.com/v1/charges?api_key=secret")
	resp := &http.Response{
		StatusCode: http.StatusTooManyRequests,
		Header:     http.Header{"Retry-After": {"120"}},
		Body:       http.NoBody,
		Request:    &http.Request{Method: http.MethodPost, URL: u},
	}
	err := retry.FromResponse(resp)
	fmt.Println(retry.Classify(err), err)
	fmt.Println(retry.Policy{}.Delay("payment:charge", 0, err))

	// Errors nobody recognises get a few retries.
	fmt.Println(retry.Classify(errors.New("something odd")))
	// Output:
	// permanent
	// wait POST https://api.example.com/v1/charges: 429 Too Many Requests
	// 2m0s
	// unknown
}

func ExamplePolicy_Delay() {
	timeout := errors.New("upstream timeout")
	exact := retry.Policy{Jitter: retry.Disabled}
	jittered := retry.Policy{Rand: retry.SeededRand(1)} // seeded for a stable output
	for retried := range 6 {
		fmt.Println(exact.Delay("order:send_receipt", retried, timeout),
			jittered.Delay("order:send_receipt", retried, timeout).Round(time.Second))
	}
	// Output:
	// 30s 28s
	// 2m0s 2m20s
	// 8m0s 9m3s
	// 32m0s 36m8s
	// 1h0m0s 59m29s
	// 1h0m0s 1h10m52s
}
