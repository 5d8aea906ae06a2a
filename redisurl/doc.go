// Package redisurl turns a REDIS_URL setting into Asynq connection options,
// and hides the secrets in such a URL before it is logged.
//
// Parse accepts five forms:
//
//	redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]
//	rediss://[[USER]:PASSWORD@]HOST[:PORT][/DB]           (TLS)
//	redis-socket://[[USER]:PASSWORD@]/PATH/TO/SOCKET[?db=DB]
//	redis-sentinel://[[USER]:PASSWORD@]HOST[:PORT],HOST[:PORT],...[/DB]?master=NAME[&sentinel_username=U][&sentinel_password=P]
//	redis-cluster://[[USER]:PASSWORD@]HOST[:PORT],HOST[:PORT],...
//
// PORT defaults to 6379, or 26379 for the sentinels of redis-sentinel; DB
// defaults to 0. The user and password are those of the Redis servers that hold
// the data; sentinels that require their own authentication take theirs from
// sentinel_username and sentinel_password. Special characters in a password
// must be percent-encoded ("/" is %2F, "?" is %3F, "#" is %23, "%" is %25).
//
// Parse is stricter than asynq.ParseRedisURI: it rejects what it cannot use
// (a missing host, a database that is not a number, an unknown query parameter,
// a socket path written with two slashes) instead of connecting somewhere
// unexpected, and it keeps the user name and the master's password for
// Sentinel. Its errors name the bad part and never contain the password.
package redisurl
