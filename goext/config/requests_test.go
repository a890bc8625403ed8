package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLeaderRequestIdleTimeout(t *testing.T) {
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, DefaultLeaderRequestIdleTimeout, c.LeaderRequestIdle)

	c, err = load(t, map[string]string{EnvLeaderRequestIdleTimeoutSecs: " 90 "})
	require.NoError(t, err)
	require.Equal(t, 90*time.Second, c.LeaderRequestIdle)

	c, err = load(t, map[string]string{EnvLeaderRequestIdleTimeoutSecs: "86400"})
	require.NoError(t, err)
	require.Equal(t, MaxLeaderRequestIdleTimeout, c.LeaderRequestIdle)

	for raw, reason := range map[string]string{
		"0":                   "must be at least 1",
		"-5":                  "must not be negative",
		"10m":                 "not an integer",
		"86401":               "must be at most 86400 seconds",
		"9223372036854775807": "must be at most 86400 seconds",
	} {
		_, err := load(t, map[string]string{EnvLeaderRequestIdleTimeoutSecs: raw})
		require.ErrorContains(t, err, EnvLeaderRequestIdleTimeoutSecs, raw)
		require.ErrorContains(t, err, reason, raw)
	}
}
