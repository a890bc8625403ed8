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

	env := map[string]string{EnvDiskCacheGB: "5", EnvDiskCacheDir: dir, "HOME": t.TempDir()}
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

// TestPersistentTierRefusesSharedDir: a directory other users can write
// (sticky or not, as /tmp) is refused for a persistent disk tier, naming
// DYN_KVBM_DISK_CACHE_DIR; without persistence it still works.
func TestPersistentTierRefusesSharedDir(t *testing.T) {
	machine(t, 16e9, 100e9)
	for _, mode := range []os.FileMode{0o777 | os.ModeSticky, 0o777, 0o770} {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, mode))
		env := map[string]string{EnvDiskCacheGB: "1", EnvDiskCacheDir: dir, EnvDiskPersist: "true", "HOME": t.TempDir()}
		_, err := load(t, env)
		requireVarError(t, err, EnvDiskCacheDir, "writable by other users")
		require.ErrorContains(t, err, "private subdirectory")
		require.ErrorContains(t, err, "mkdir -m 700 "+dir+"/kvbm-")

		delete(env, EnvDiskPersist)
		c, err := load(t, env)
		require.NoError(t, err, "mode %v", mode)
		require.Equal(t, dir, c.DiskCacheDir)
	}
	// A private directory, existing or to be created, is fine.
	dir := filepath.Join(t.TempDir(), "mine", "kvbm")
	c, err := load(t, map[string]string{EnvDiskCacheGB: "1", EnvDiskCacheDir: dir, EnvDiskPersist: "true",
		"HOME": t.TempDir()})
	require.NoError(t, err)
	require.Equal(t, dir, c.DiskCacheDir)
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm(), "a directory kvbm creates for persistence is private")
}

// TestPersistentTierDefaultDir: with persistence on and no
// DYN_KVBM_DISK_CACHE_DIR the tier goes to $XDG_CACHE_HOME/kvbm (else
// $HOME/.cache/kvbm), created private, not to /tmp; without persistence
// the default stays /tmp/.
func TestPersistentTierDefaultDir(t *testing.T) {
	machine(t, 16e9, 100e9)
	xdg, home := t.TempDir(), t.TempDir()
	env := map[string]string{EnvDiskCacheGB: "1", EnvDiskPersist: "true", "XDG_CACHE_HOME": xdg, "HOME": home}
	c, err := load(t, env)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(xdg, "kvbm"), c.DiskCacheDir)
	fi, err := os.Stat(c.DiskCacheDir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	env["XDG_CACHE_HOME"] = "relative/ignored"
	c, err = load(t, env)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(home, ".cache", "kvbm"), c.DiskCacheDir)

	delete(env, "XDG_CACHE_HOME")
	delete(env, "HOME")
	_, err = load(t, env)
	requireVarError(t, err, EnvDiskCacheDir, "neither $XDG_CACHE_HOME nor $HOME")

	// kvbm's own directory made shared is refused too.
	env["HOME"] = home
	require.NoError(t, os.Chmod(filepath.Join(home, ".cache", "kvbm"), 0o777))
	_, err = load(t, env)
	requireVarError(t, err, EnvDiskCacheDir, "chmod 700")

	c, err = load(t, map[string]string{EnvDiskCacheGB: "1", "HOME": home})
	require.NoError(t, err)
	require.Equal(t, DefaultDiskCacheDir, c.DiskCacheDir, "without persistence the default is unchanged")
}
