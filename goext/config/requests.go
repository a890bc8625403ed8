package config

import (
	"fmt"
	"time"
)

// EnvLeaderRequestIdleTimeoutSecs: how long the leader keeps the state of a
// request it has heard nothing about (no match, allocation, step update or
// finished load) before forgetting it. Engines finish every request they
// start, but one that never does (an aborted client whose finish was never
// reported, an adapter error) would otherwise hold its token list, hashes
// and staged pins for the life of the process.
const EnvLeaderRequestIdleTimeoutSecs = "DYN_KVBM_LEADER_REQUEST_IDLE_TIMEOUT_SECS"

const (
	// DefaultLeaderRequestIdleTimeout is far longer than any gap between
	// two calls about a live request (the engine touches every running
	// request each step, and a waiting one each time it tries to schedule
	// it), yet short enough that abandoned requests cannot pile up.
	DefaultLeaderRequestIdleTimeout = 10 * time.Minute
	// MaxLeaderRequestIdleTimeout caps the setting: a longer one would let
	// abandoned requests accumulate for days.
	MaxLeaderRequestIdleTimeout = 24 * time.Hour
)

// requestIdleTimeout reads EnvLeaderRequestIdleTimeoutSecs (seconds, 1 to
// the cap).
func (p *parser) requestIdleTimeout() time.Duration {
	raw, set := p.get(EnvLeaderRequestIdleTimeoutSecs)
	if !set {
		return DefaultLeaderRequestIdleTimeout
	}
	maxSecs := int64(MaxLeaderRequestIdleTimeout / time.Second)
	n, ok := p.integer(EnvLeaderRequestIdleTimeoutSecs, 1)
	if ok && n > maxSecs {
		p.fail(EnvLeaderRequestIdleTimeoutSecs, raw, fmt.Sprintf("must be at most %d seconds", maxSecs))
		ok = false
	}
	if !ok {
		return DefaultLeaderRequestIdleTimeout
	}
	return time.Duration(n) * time.Second
}
