package config

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// The key behind the MACs of stored KV (goext/integrity). Unset, G4 derives
// its key from the S3 secret key and bucket, and the persistent G3 from a
// per-user secret kvbm creates once; either variable overrides both.
const (
	EnvStorageSecret     = "DYN_KVBM_STORAGE_SECRET"
	EnvStorageSecretFile = "DYN_KVBM_STORAGE_SECRET_FILE"
)

// MinStorageSecretBytes is the shortest storage secret accepted, and
// MaxStorageSecretBytes the longest file read as one.
const (
	MinStorageSecretBytes = 16
	MaxStorageSecretBytes = 4096
)

// storageSecret reads DYN_KVBM_STORAGE_SECRET or, from a file,
// DYN_KVBM_STORAGE_SECRET_FILE (not both). A file must be a regular file
// that group and others cannot read or write.
func (p *parser) storageSecret() []byte {
	lit := p.str(EnvStorageSecret, "")
	path := p.path(EnvStorageSecretFile, "")
	switch {
	case lit != "" && path != "":
		p.fail(EnvStorageSecretFile, path, "set only one of "+EnvStorageSecret+" and "+EnvStorageSecretFile)
		return nil
	case lit != "":
		if len(lit) < MinStorageSecretBytes {
			// The value itself is never echoed.
			p.fail(EnvStorageSecret, "<hidden>", fmt.Sprintf("must be at least %d bytes", MinStorageSecretBytes))
			return nil
		}
		return []byte(lit)
	case path != "":
		s, err := readSecretFile(path)
		if err != nil {
			p.fail(EnvStorageSecretFile, path, err.Error())
			return nil
		}
		return s
	}
	return nil
}

// errprefix: its errors are only the reason of a VarError, which names the variable.
func readSecretFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file")
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("mode %v: readable or writable by group or others (chmod 600)", fi.Mode().Perm())
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxStorageSecretBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxStorageSecretBytes {
		return nil, fmt.Errorf("longer than %d bytes", MaxStorageSecretBytes)
	}
	if len(b) < MinStorageSecretBytes {
		return nil, fmt.Errorf("must hold at least %d bytes", MinStorageSecretBytes)
	}
	return b, nil
}

// storageSecretDir is kvbm's private directory for the per-user secret:
// $XDG_CONFIG_HOME/kvbm (an absolute $XDG_CONFIG_HOME only, as the XDG
// specification says), else $HOME/.config/kvbm. Both are read from the
// configuration's variables, not the process environment: a library loaded
// into an engine's worker process may not see the environment Python sees.
func (p *parser) storageSecretDir() string {
	if v, set := p.get("XDG_CONFIG_HOME"); set && filepath.IsAbs(strings.TrimSpace(v)) {
		return filepath.Join(strings.TrimSpace(v), "kvbm")
	}
	if v, set := p.get("HOME"); set && filepath.IsAbs(strings.TrimSpace(v)) {
		return filepath.Join(strings.TrimSpace(v), ".config", "kvbm")
	}
	p.fail(EnvStorageSecret, "", "required with "+EnvDiskPersist+" when neither $XDG_CONFIG_HOME nor $HOME is set "+
		"(the persistent tier's MAC key derives from a per-user secret kept in $XDG_CONFIG_HOME/kvbm)")
	return ""
}
