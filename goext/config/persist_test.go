package config

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPersistentTierSpaceCountsAsFree: a restarted engine reopens its
// persistent tier file, so the disk space check must not count that file
// against it; without persistence it does.
func TestPersistentTierSpaceCountsAsFree(t *testing.T) {
	machine(t, 16e9, 1e9)
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "kvbm-g3-0123456789abcdef0123456789abcdef-rank0.tier"))
	require.NoError(t, err)
	require.NoError(t, f.Truncate(5e9)) // sparse: the size is what counts
	require.NoError(t, f.Close())

	env := map[string]string{EnvDiskCacheGB: "5", EnvDiskCacheDir: dir}
	_, err = load(t, env)
	requireVarError(t, err, EnvDiskCacheGB, "disk space")

	env[EnvDiskPersist] = "true"
	c, err := load(t, env)
	require.NoError(t, err)
	require.True(t, c.DiskPersist)
	require.Contains(t, c.Summary(), "persistent on")

	env[EnvDiskPersist] = "maybe"
	_, err = load(t, env)
	requireVarError(t, err, EnvDiskPersist, "not a boolean")
}
