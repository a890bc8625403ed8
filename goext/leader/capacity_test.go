package leader

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
)

// DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS=2147483647
// passed validation and the leader then allocated its index for 2³¹ blocks
// (154 GB of 72-byte blocks) and aborted. It must be a start-up error naming
// the variable.
func TestNewRefusesTiersBeyondTheMachine(t *testing.T) {
	for name, env := range map[string]map[string]string{
		"override beyond memory": {config.EnvCPUCacheOverrideBlocks: "2147483647"},
		"GB of tiny blocks":      {config.EnvDiskCacheGB: "3", config.EnvDiskCacheDir: t.TempDir()},
	} {
		cfg, err := config.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		require.NoError(t, err, name)
		bytesPerBlock := int64(1 << 20)
		if _, ok := env[config.EnvDiskCacheGB]; ok {
			bytesPerBlock = 1
		}
		_, err = New(Options{Config: cfg, BlockSize: 16, BytesPerBlock: bytesPerBlock, NumWorkers: 1})
		require.Error(t, err, name)
		for k := range env {
			if k != config.EnvDiskCacheDir {
				require.ErrorContains(t, err, k, name)
			}
		}
	}
}
