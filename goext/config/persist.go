package config

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvbm/kvbm/goext/integrity"
)

// persistentTierBytes is the space the persistent disk tier files in dir
// occupy (kvbm-g3-*.tier, goext/storage). With DYN_KVBM_DISK_PERSIST a
// restarted engine reopens its own file instead of allocating a new one, so
// that space counts as available to it. Files of other fingerprints are
// counted too (which file is this engine's is known only once the model is
// loaded): the check is then only lenient, and allocating the file still
// fails clearly when the space is missing.
func persistentTierBytes(dir string) uint64 {
	matches, _ := filepath.Glob(filepath.Join(dir, "kvbm-g3-*.tier"))
	var n uint64
	for _, m := range matches {
		if fi, err := os.Lstat(m); err == nil && fi.Mode().IsRegular() && strings.HasSuffix(m, ".tier") {
			n += uint64(fi.Size())
		}
	}
	return n
}

// persistentDir settles the directory of a persistent disk tier, whose
// blocks are recovered at the next start and so must not be anyone else's
// to write:
//   - DYN_KVBM_DISK_CACHE_DIR unset: not /tmp but $XDG_CACHE_HOME/kvbm, else
//     $HOME/.cache/kvbm, created private (0700);
//   - set to a directory that does not exist yet: created private;
//   - set to one that group or others can write (sticky or not, as /tmp):
//     refused, with a private subdirectory suggested. In a shared sticky
//     directory another user can create the tier file, or any directory
//     kvbm would make for itself, before kvbm does.
//
// Without persistence the non-persistent default /tmp/ is kept.
func (p *parser) persistentDir(c *Config) {
	if !c.DiskPersist || !c.DiskEnabled() || !p.ok(EnvDiskCacheDir, EnvDiskPersist) {
		return
	}
	if _, set := p.get(EnvDiskCacheDir); !set {
		dir, err := p.defaultPersistentDir()
		if err == nil {
			err = integrity.PrivateDir(dir)
		}
		if err != nil {
			p.fail(EnvDiskCacheDir, dir, "the default directory of a persistent disk tier ("+EnvDiskPersist+
				"): "+err.Error())
			return
		}
		c.DiskCacheDir = dir
		return
	}
	dir := c.DiskCacheDir
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if err := integrity.PrivateDir(dir); err != nil {
			p.fail(EnvDiskCacheDir, dir, err.Error())
		}
	case err != nil:
		p.fail(EnvDiskCacheDir, dir, err.Error())
	case fi.IsDir() && fi.Mode().Perm()&0o022 != 0:
		p.fail(EnvDiskCacheDir, dir, fmt.Sprintf("writable by other users (mode %v): a persistent disk tier (%s) "+
			"could recover their files; use a private subdirectory (mkdir -m 700 %s), or unset %s for the "+
			"default $XDG_CACHE_HOME/kvbm", fi.Mode(), EnvDiskPersist, filepath.Join(dir, "kvbm-"+userName()),
			EnvDiskCacheDir))
	}
}

// defaultPersistentDir is $XDG_CACHE_HOME/kvbm (an absolute
// $XDG_CACHE_HOME only, as the XDG specification says), else
// $HOME/.cache/kvbm.
func (p *parser) defaultPersistentDir() (string, error) {
	if v, set := p.get("XDG_CACHE_HOME"); set && filepath.IsAbs(strings.TrimSpace(v)) {
		return filepath.Join(strings.TrimSpace(v), "kvbm"), nil
	}
	if v, set := p.get("HOME"); set && filepath.IsAbs(strings.TrimSpace(v)) {
		return filepath.Join(strings.TrimSpace(v), ".cache", "kvbm"), nil
	}
	return "", errors.New("neither $XDG_CACHE_HOME nor $HOME is set: set DYN_KVBM_DISK_CACHE_DIR to a private directory") // errprefix: wrapped: the reason of a VarError
}

// userName names this user for a suggested directory.
func userName() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return strconv.Itoa(os.Geteuid())
}
