package config

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/internal/checked"
)

// TestCountCaps: every count variable that sizes an allocation takes values
// up to its cap and refuses the next one, and the value that used to abort
// the process (2147483647, which parsed), with an error that names the
// variable, gives the value and says the cap.
func TestCountCaps(t *testing.T) {
	field := map[string]func(*Config) int{
		EnvCPUCacheOverrideBlocks:  func(c *Config) int { return c.CPUCacheOverrideBlocks },
		EnvDiskCacheOverrideBlocks: func(c *Config) int { return c.DiskCacheOverrideBlocks },
		EnvCacheStatsMaxRequests:   func(c *Config) int { return c.CacheStatsMaxRequests },
		EnvMaxConcurrentTransfers:  func(c *Config) int { return c.MaxConcurrentTransfers },
		EnvMaxTransferBatchSize:    func(c *Config) int { return c.MaxTransferBatchSize },
		EnvConsolidatorMaxBlocks:   func(c *Config) int { return c.ConsolidatorMaxBlocks },
		EnvObjectNumBlocks:         func(c *Config) int { return c.Object.NumBlocks },
		EnvZMQMaxMessageMB:         func(c *Config) int { return c.ZMQMaxMessageMB },
	}
	require.Len(t, field, len(countCaps), "a row for every capped variable")
	caps := map[string]int{
		EnvCPUCacheOverrideBlocks:  math.MaxInt32,
		EnvDiskCacheOverrideBlocks: math.MaxInt32,
		EnvCacheStatsMaxRequests:   1_000_000,
		EnvMaxConcurrentTransfers:  64,
		EnvMaxTransferBatchSize:    65536,
		EnvConsolidatorMaxBlocks:   16777216,
		EnvObjectNumBlocks:         10_000_000,
		EnvZMQMaxMessageMB:         1024,
	}
	for name, get := range field {
		c, ok := countCaps[name]
		require.True(t, ok, name)
		require.Equal(t, caps[name], c.max, "%s: the documented cap", name)
		env := func(v string) map[string]string {
			e := map[string]string{name: v, EnvDiskCacheDir: t.TempDir()}
			if name == EnvObjectNumBlocks { // read only with G4 on
				e[EnvObjectEnabled], e[EnvObjectBucket] = "1", "kvbm-test"
			}
			return e
		}
		t.Run(name, func(t *testing.T) {
			cfg, err := FromEnv(env(fmt.Sprint(c.max)))
			require.NoError(t, err, "the cap itself is valid")
			require.Equal(t, c.max, get(cfg))
			for _, bad := range []string{fmt.Sprint(c.max + 1), "2147483647", "2147483648", "9223372036854775807"} {
				if bad == fmt.Sprint(c.max) {
					continue
				}
				_, err := FromEnv(env(bad))
				requireVarError(t, err, name, fmt.Sprintf("must be at most %d", c.max))
				require.Contains(t, err.Error(), fmt.Sprintf("%s=%q: must be at most %d (", name, bad, c.max))
			}
		})
	}
}

// TestCapErrorMessage: the whole message, as an operator reads it.
func TestCapErrorMessage(t *testing.T) {
	_, err := FromEnv(map[string]string{EnvCacheStatsMaxRequests: "2147483647"})
	require.EqualError(t, err, `config: invalid DYN_KVBM_CACHE_STATS_MAX_REQUESTS="2147483647": `+
		`must be at most 1000000 (the hit-rate window keeps an entry per request)`)
	_, err = FromEnv(map[string]string{EnvZMQMaxMessageMB: "2147483647"})
	require.EqualError(t, err, `config: invalid DYN_KVBM_ZMQ_MAX_MESSAGE_MB="2147483647": `+
		`must be at most 1024 (a ZeroMQ peer may make kvbm allocate a message this large)`)
}

// uncappedCounts are the count variables without a cap of countCaps, and why.
var uncappedCounts = map[string]string{
	EnvHostOffloadPrefixMinPriority: "a priority threshold: it sizes nothing",
	EnvMetricsMaxConnections:        "capped at MaxMetricsConnections and half the open-file limit (FromLookup)",
}

// TestEveryCountIsClassified reads the package's sources: every integer
// variable is read either with capped (and has a cap) or with count (and is
// listed in uncappedCounts with the reason it needs none), so a new count
// setting cannot arrive without a decision about its cap.
func TestEveryCountIsClassified(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	call := regexp.MustCompile(`p\.(count|capped)\((Env\w+)`)
	constant := regexp.MustCompile(`(?m)^\s*(Env\w+)\s*=\s*"(\w+)"`)
	names := map[string]string{} // Go constant -> variable
	var calls [][]string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range constant.FindAllStringSubmatch(string(src), -1) {
			names[m[1]] = m[2]
		}
		calls = append(calls, call.FindAllStringSubmatch(string(src), -1)...)
	}
	used := map[string]bool{}
	for _, m := range calls {
		v, ok := names[m[2]]
		require.True(t, ok, "constant %s", m[2])
		switch m[1] {
		case "capped":
			require.Contains(t, countCaps, v, "%s is read with capped but has no cap", v)
			used[v] = true
		case "count":
			require.Contains(t, uncappedCounts, v, "%s is read with count: give it a cap (countCaps, capped) "+
				"or say in uncappedCounts why it needs none", v)
		}
	}
	require.Len(t, used, len(countCaps), "every cap is used")
	require.GreaterOrEqual(t, len(calls), 10)
}

// TestCheckBlocksOverflow: blocks × bytes per block beyond 64 bits is an
// error naming both, not a product that wraps (2^20 blocks of 2^44 bytes
// wrapped to 0 bytes, which fit anywhere).
func TestCheckBlocksOverflow(t *testing.T) {
	machine(t, 1<<40, 1<<40)
	cfg, err := FromEnv(map[string]string{EnvCPUCacheOverrideBlocks: "1048576"})
	require.NoError(t, err)
	err = cfg.CheckBlocks(1 << 44)
	requireVarError(t, err, EnvCPUCacheOverrideBlocks, "1048576 blocks × 17592186044416 bytes per block overflows")
	_, _, err = cfg.TierBlocks(1<<44, 1)
	requireVarError(t, err, EnvCPUCacheOverrideBlocks, "overflows")
}

func TestMulSizes(t *testing.T) {
	for _, tc := range []struct {
		in   []int64
		want int64
		ok   bool
	}{
		{nil, 1, true},
		{[]int64{3, 5, 7}, 105, true},
		{[]int64{1 << 31, 1 << 31}, 1 << 62, true},
		{[]int64{math.MaxInt64, 1}, math.MaxInt64, true},
		{[]int64{1 << 20, 1 << 44}, 0, false}, // 2^64: wraps to 0 unchecked
		{[]int64{1 << 32, 1 << 31}, 0, false}, // 2^63: negative unchecked
		{[]int64{math.MaxInt64, 2}, 0, false},
		{[]int64{0, math.MaxInt64, 2}, 0, true},
		{[]int64{-1, 4}, 0, false},
	} {
		got, ok := checked.Mul(tc.in...)
		require.Equal(t, tc.ok, ok, "%v", tc.in)
		if ok {
			require.Equal(t, tc.want, got, "%v", tc.in)
		}
	}
}

// TestDiskTierBookkeeping: a disk tier whose file fits on disk but whose
// blocks are so many that their bookkeeping alone exceeds memory (4 TB of
// 4 KiB blocks: 976562500 blocks, 125 GB of bookkeeping on a 16 GB machine)
// fails by name before anything is allocated; the same tier of 1 MiB blocks
// fits.
func TestDiskTierBookkeeping(t *testing.T) {
	machine(t, 16e9, 10e12)
	c, err := FromEnv(map[string]string{EnvDiskCacheGB: "4000", EnvDiskCacheDir: t.TempDir()})
	require.NoError(t, err)
	requireVarError(t, c.CheckBlocks(4096), EnvDiskCacheGB,
		"976562500 blocks of 4096 bytes: their bookkeeping (128 bytes a block) needs 125000000000 bytes, "+
			"more than the 16000000000 bytes of memory available")
	require.NoError(t, c.CheckBlocks(1<<20))
}
