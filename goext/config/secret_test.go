package config

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestStorageSecret(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	require.NoError(t, os.WriteFile(good, []byte("0123456789abcdef-file"), 0o600))
	open := filepath.Join(dir, "open")
	require.NoError(t, os.WriteFile(open, []byte("0123456789abcdef-file"), 0o644))
	short := filepath.Join(dir, "short")
	require.NoError(t, os.WriteFile(short, []byte("x"), 0o600))

	for _, tc := range []struct {
		name    string
		env     map[string]string
		want    string
		errVar  string
		errText string
	}{
		{name: "unset", env: map[string]string{}},
		{name: "literal", env: map[string]string{EnvStorageSecret: "0123456789abcdef"}, want: "0123456789abcdef"},
		{name: "file", env: map[string]string{EnvStorageSecretFile: good}, want: "0123456789abcdef-file"},
		{name: "too short, value not echoed", env: map[string]string{EnvStorageSecret: "tiny-secret"},
			errVar: EnvStorageSecret, errText: "at least 16 bytes"},
		{name: "both", env: map[string]string{EnvStorageSecret: "0123456789abcdef", EnvStorageSecretFile: good},
			errVar: EnvStorageSecretFile, errText: "only one of"},
		{name: "file readable by others", env: map[string]string{EnvStorageSecretFile: open},
			errVar: EnvStorageSecretFile, errText: "chmod 600"},
		{name: "short file", env: map[string]string{EnvStorageSecretFile: short},
			errVar: EnvStorageSecretFile, errText: "at least 16 bytes"},
		{name: "missing file", env: map[string]string{EnvStorageSecretFile: filepath.Join(dir, "none")},
			errVar: EnvStorageSecretFile, errText: "no such file"},
		{name: "directory", env: map[string]string{EnvStorageSecretFile: dir},
			errVar: EnvStorageSecretFile, errText: "not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := FromLookup(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			if tc.errVar != "" {
				require.Error(t, err)
				require.ErrorContains(t, err, tc.errVar)
				require.ErrorContains(t, err, tc.errText)
				require.NotContains(t, err.Error(), "tiny-secret", "a secret is never echoed")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, string(c.StorageSecret))
		})
	}
}

// The per-user secret's directory comes from the configuration's variables
// (what the engine's Python passes), only where the persistent tier needs it.
func TestStorageSecretDir(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		want    string
		errText string
	}{
		{name: "no persistence", env: map[string]string{"HOME": "/home/u"}},
		{name: "home", env: map[string]string{EnvDiskPersist: "true", "HOME": "/home/u"}, want: "/home/u/.config/kvbm"},
		{name: "xdg wins", env: map[string]string{EnvDiskPersist: "true", "HOME": "/home/u", "XDG_CONFIG_HOME": "/x"},
			want: "/x/kvbm"},
		{name: "relative xdg ignored", env: map[string]string{EnvDiskPersist: "true", "HOME": "/home/u",
			"XDG_CONFIG_HOME": "rel"}, want: "/home/u/.config/kvbm"},
		{name: "a secret needs no directory", env: map[string]string{EnvDiskPersist: "true",
			EnvStorageSecret: "0123456789abcdef"}},
		{name: "neither", env: map[string]string{EnvDiskPersist: "true"}, errText: EnvStorageSecret},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{EnvDiskCacheDir: t.TempDir()}
			for k, v := range tc.env {
				env[k] = v
			}
			c, err := FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
			if tc.errText != "" {
				require.ErrorContains(t, err, tc.errText)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, c.StorageSecretDir)
		})
	}
}
