-- keel:additive
-- Dashboard sessions ended before their expiry (signed out). A session
-- cookie is signed and names its session id; every web server checks this
-- table, so a signed-out cookie stops working on every replica and after a
-- restart, not only in the process that signed it out. A row is needed
-- only until the cookie would have expired anyway (expires_at); later rows
-- are deleted as new ones are written. Older binaries never read it.
CREATE TABLE IF NOT EXISTS keel_web_sessions_ended (
    session_id text PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    ended_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS keel_web_sessions_ended_expiry ON keel_web_sessions_ended (expires_at);
