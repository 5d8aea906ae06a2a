// Package publicapi holds no code: its test checks that keel's public
// packages do not hand their users types they cannot name, from keel's
// internal packages but for the aliases it lists as reviewed.
package publicapi
