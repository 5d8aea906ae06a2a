// Package web is keel's dashboard: one HTTP server with keel's own pages
// (queues, the jobs list, dead letters, look-up by business key, replay,
// discard and step resolution), asynqmon under /monitoring/, /metrics and
// /healthz.
//
// # Pages
//
// The overview shows each queue's depth by state, the age of its oldest
// pending task, processed and failed rates with charts of the last hour
// (sampled by the server itself every 10s) and its dead letters. The
// dead-letter page lists the ledger's dead jobs in a table (job, queue,
// reason, class, attempts, age) whose rows open for the last error, payload
// summary, trace id and steps, filtered by kind, queue, error class and
// time. A job's page answers "what state is it
// in, and who handles it next": status, attempts, lease holder and expiry,
// timestamps, steps and the audit log. Operators replay, discard (with a
// note), resolve steps in doubt, and act on every dead job a filter matches
// after confirming the count; each action lands in the audit log under the
// operator's name. The jobs list shows every job in the ledger, filtered by
// status (or "in doubt"), kind, queue, business-key prefix and error text,
// in keyset pages, optionally refreshing itself with a meta refresh; dead
// jobs ticked there go through the same confirmed-count bulk actions. A
// job's page also says what the job waits for and what waits for it
// (tasks.After), and an operator may release a waiting job; a workflow's
// page (/workflows/{id}) draws its tasks as a graph in inline SVG. Pages
// are rendered on the server with html/template, so everything a job
// carries is escaped (and invisible or bidi control characters are shown as
// codes), and they run no script at all.
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
// header is configured. Requests for a Host the server does not answer to
// (see Config.AllowedHosts) get 421, which stops DNS rebinding.
//
// Sign-in attempts are counted before the password is compared: per client
// address (read from X-Forwarded-For only behind Config.TrustedProxies; an
// IPv6 client by its /56), per account as a slowdown rather than a
// lock-out, from which browsers and addresses the user signed in from
// before are exempt, and per device; concurrent compares are capped
// (Config.LoginConcurrency), with part of them kept for those known
// clients. Signing out is recorded in the ledger, so it holds on every
// replica and after a restart. Sign-ins, failed sign-ins and operator writes
// through asynqmon are written to the audit log, and asynqmon's "run" of a
// keel job's archived task is keel's replay.
package web
