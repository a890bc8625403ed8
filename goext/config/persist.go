package config

import (
	"os"
	"path/filepath"
	"strings"
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
