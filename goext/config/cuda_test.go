package config

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCUDAKnobValues: the copier's tuning variables are unset, a positive
// count of their unit, or an error that names the variable (the cases the
// copier checked when it read them itself).
func TestCUDAKnobValues(t *testing.T) {
	for _, tc := range []struct {
		value string
		want  int64
		bad   bool
	}{
		{"", 0, false},
		{"  ", 0, false},
		{"64", 64 << 20, false},
		{" 3 ", 3 << 20, false},
		{"0", 0, true},
		{"-2", 0, true},
		{"12MiB", 0, true},
		{"1.5", 0, true},
		{"9223372036854775807", 0, true},
	} {
		c, err := FromEnv(map[string]string{EnvCUDAStagingMiB: tc.value})
		if tc.bad {
			require.ErrorContains(t, err, EnvCUDAStagingMiB, tc.value)
			require.ErrorContains(t, err, tc.value)
			continue
		}
		require.NoError(t, err, tc.value)
		require.Equal(t, tc.want, c.CUDA.StagingBytes, tc.value)
	}
}

// TestCUDAKnobRanges: the ranges the copier enforces are checked at start.
func TestCUDAKnobRanges(t *testing.T) {
	for name, value := range map[string]string{
		EnvCUDAStagedThreads:  "48",
		EnvCUDADMAStreams:     "9",
		EnvCUDASplitStreams:   "9",
		EnvCUDASplitProbeUs:   "0",
		EnvCUDASplitPct:       "100",
		EnvCUDAStagedPriority: "medium",
		EnvCUDACopy:           "teleport",
		EnvCUDASplitBusy:      "dma",
	} {
		_, err := FromEnv(map[string]string{name: value})
		require.ErrorContains(t, err, name)
		require.ErrorContains(t, err, value)
	}
	c, err := FromEnv(map[string]string{EnvCUDAStagedThreads: "256", EnvCUDADMAStreams: "8", EnvCUDASplitPct: "99",
		EnvCUDAStagedPriority: " LOW ", EnvCUDACopy: "zero_copy", EnvCUDAKernels: "/k.fatbin", EnvCUDASplitProbeUs: "500",
		EnvCUDASplitBusy: " Batch"})
	require.NoError(t, err)
	require.Equal(t, CUDA{Copy: "zero_copy", StagedThreads: 256, DMAStreams: 8, SplitPercent: 99, StagedLowPriority: true,
		KernelsFile: "/k.fatbin", SplitProbeMicros: 500, SplitBusyBatch: true}, c.CUDA)
	c, err = FromEnv(map[string]string{EnvCUDASplitBusy: "blocks"})
	require.NoError(t, err)
	require.False(t, c.CUDA.SplitBusyBatch)
}

// TestLogLevel: DYN_LOG as capi's logger read it; unset leaves the level alone.
func TestLogLevel(t *testing.T) {
	for v, want := range map[string]slog.Level{"debug": slog.LevelDebug, "TRACE": slog.LevelDebug,
		"warning": slog.LevelWarn, "error": slog.LevelError, "chatty": slog.LevelInfo} {
		c, err := FromEnv(map[string]string{EnvLog: v})
		require.NoError(t, err)
		require.Equal(t, LogLevel{Level: want, Set: true}, c.Log, v)
	}
	c, err := FromEnv(map[string]string{})
	require.NoError(t, err)
	require.False(t, c.Log.Set)
}
