// Package web is keel's dashboard: one HTTP server with keel's own pages
// (queues, dead letters, look-up by business key, replay, discard and step
// resolution), asynqmon under /monitoring/, /metrics and /healthz.
//
// # Pages
//
// The overview shows each queue's depth by state, the age of its oldest
// pending task, processed and failed rates with small charts of the last
// hour (sampled by the server itself every 10s) and its dead letters. The
// dead-letter page lists the ledger's dead jobs with their reason, attempts,
// last error, payload summary, business key, trace id and steps, filtered by
// kind, queue, error class and time. A job's page answers "what state is it
// in, and who handles it next": status, attempts, lease holder and expiry,
// timestamps, steps and the audit log. Operators replay, discard (with a
// note), resolve steps in doubt, and act on every dead job a filter matches
// after confirming the count; each action lands in the audit log under the
// operator's name. Pages are rendered on the server with html/template, so
// everything a job carries is escaped, and they run no script at all.
//
// # Security
//
// Nothing but /healthz is served to anonymous callers (and /metrics only
// when MetricsPublic is set, or with the MetricsToken bearer token). Users
// sign in with a password (Users, from KEEL_WEB_USERS; see ParseUsers and
// HashPassword) into an HMAC-signed session cookie that is HttpOnly,
// SameSite=Strict, and Secure behind HTTPS; or an SSO proxy in front names
// them in a header (ProxyUserHeader). Viewers read; operators also act, and
// get asynqmon's writable UI. Every state-changing request must come from
// the server's own origin (Origin, or Referer, and Sec-Fetch-Site), which is
// what protects asynqmon's API; keel's forms also carry a per-session token.
// Responses carry a Content-Security-Policy (a separate, hash-pinned one for
// asynqmon's app), nosniff, frame denial and a same-origin referrer policy.
// New refuses an address other machines can reach when no user and no proxy
// header is configured.
package web
