package config

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// machine fixes the capacity the checks see: memory and disk bytes.
func machine(t *testing.T, memory, disk uint64) {
	t.Helper()
	mem, dsk := availableMemory, availableDisk
	availableMemory = func() (uint64, bool) { return memory, true }
	availableDisk = func(string) (uint64, bool) { return disk, true }
	t.Cleanup(func() { availableMemory, availableDisk = mem, dsk })
}

// requireVarError asserts err holds a *VarError for name whose reason
// contains reason.
func requireVarError(t *testing.T, err error, name, reason string) {
	t.Helper()
	require.Error(t, err)
	var joined interface{ Unwrap() []error }
	errs := []error{err}
	if errors.As(err, &joined) {
		errs = joined.Unwrap()
	}
	for _, e := range errs {
		var ve *VarError
		if errors.As(e, &ve) && ve.Name == name {
			require.Contains(t, ve.Reason, reason)
			return
		}
	}
	t.Fatalf("no error for %s in %v", name, err)
}

// Sizes the machine cannot hold passed validation and
// then crashed the engine (DYN_KVBM_CPU_CACHE_GB=1e9 panicked in the pool).
func TestSizesBeyondTheMachineFailAtLoad(t *testing.T) {
	machine(t, 16e9, 100e9)
	_, err := load(t, map[string]string{EnvCPUCacheGB: "1e9"})
	requireVarError(t, err, EnvCPUCacheGB, "more than the 16000000000 bytes of memory available")

	_, err = load(t, map[string]string{EnvDiskCacheGB: "1000", EnvDiskCacheDir: t.TempDir()})
	requireVarError(t, err, EnvDiskCacheGB, "disk space")

	c, err := load(t, map[string]string{EnvCPUCacheGB: "16", EnvDiskCacheGB: "100", EnvDiskCacheDir: t.TempDir()})
	require.NoError(t, err)
	require.NoError(t, c.CheckBlocks(1<<20))
}

func TestCheckBlocks(t *testing.T) {
	machine(t, 16e9, 100e9)
	for _, tc := range []struct {
		name          string
		env           map[string]string
		bytesPerBlock int64
		errVar        string // "" for no error
		reason        string
	}{
		// 2147483647 blocks is a valid count, but of 72-byte blocks 154 GB.
		{"override beyond memory", map[string]string{EnvCPUCacheOverrideBlocks: "2147483647"}, 72,
			EnvCPUCacheOverrideBlocks, "memory available"},
		// 3 GB of 1-byte blocks is 3·10⁹ blocks: over the pools' int32 index.
		{"GB of tiny blocks", map[string]string{EnvDiskCacheGB: "3"}, 1,
			EnvDiskCacheGB, "at most 2147483647 blocks"},
		{"disk override beyond disk", map[string]string{EnvDiskCacheOverrideBlocks: "200000"}, 1 << 20,
			EnvDiskCacheOverrideBlocks, "disk space"},
		{"fits", map[string]string{EnvCPUCacheGB: "8", EnvDiskCacheOverrideBlocks: "1000"}, 1 << 20, "", ""},
		{"no block size yet", map[string]string{EnvCPUCacheGB: "8"}, 0, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{EnvDiskCacheDir: t.TempDir()}
			for k, v := range tc.env {
				env[k] = v
			}
			c, err := load(t, env)
			require.NoError(t, err)
			err = c.CheckBlocks(tc.bytesPerBlock)
			if tc.errVar == "" {
				require.NoError(t, err)
				return
			}
			requireVarError(t, err, tc.errVar, tc.reason)
			require.LessOrEqual(t, c.HostBlocks(tc.bytesPerBlock), MaxBlocks)
			require.LessOrEqual(t, c.DiskBlocks(tc.bytesPerBlock), MaxBlocks)
		})
	}
}

// A directory name that is not UTF-8 reached Go as
// U+FFFD (through JSON from Python) and the tier landed in another directory.
func TestDiskCacheDirMustBeUTF8(t *testing.T) {
	base := t.TempDir()
	for _, dir := range []string{filepath.Join(base, "cache\xff"), filepath.Join(base, "cache\uFFFD")} {
		_, err := load(t, map[string]string{EnvDiskCacheGB: "1", EnvDiskCacheDir: dir})
		requireVarError(t, err, EnvDiskCacheDir, "not valid UTF-8")
	}
}

func TestMachineCapacityReadable(t *testing.T) {
	mem, ok := memAvailable()
	require.True(t, ok)
	require.Positive(t, mem)
	disk, ok := diskAvailable(t.TempDir())
	require.True(t, ok)
	require.Positive(t, disk)
}

// One sizing rule for the leader, the handshake and every worker.
func TestTierBlocks(t *testing.T) {
	machine(t, 16e9, 100e9)
	dir := t.TempDir()
	c, err := load(t, map[string]string{EnvCPUCacheGB: "1", EnvDiskCacheOverrideBlocks: "7", EnvDiskCacheDir: dir})
	require.NoError(t, err)
	host, disk, err := c.TierBlocks(1e6, 2) // 2 MB a block over both ranks
	require.NoError(t, err)
	require.Equal(t, 500, host)
	require.Equal(t, 7, disk, "an override wins over GB")

	_, _, err = c.TierBlocks(1e9, 2) // 1 GB of 2 GB blocks
	requireVarError(t, err, EnvCPUCacheGB, "holds no block")

	_, _, err = c.TierBlocks(0, 1)
	require.ErrorContains(t, err, "must be positive")
	_, _, err = c.TierBlocks(1<<62, 4)
	require.ErrorContains(t, err, "overflows")

	none, err := load(t, map[string]string{})
	require.NoError(t, err, "loading needs no tier; sizing does")
	_, _, err = none.TierBlocks(1e6, 1)
	require.ErrorIs(t, err, ErrNoTier)
}
