package config

import (
	"fmt"
	"path/filepath"
	"strings"
	"time"
)

// Lifecycle of cached KV (design §12): expiry of G3 blocks and G4 objects,
// and the operator endpoint that purges and reports.
const (
	EnvObjectTTLSecs = "DYN_KVBM_OBJECT_TTL_SECS"
	EnvDiskTTLSecs   = "DYN_KVBM_DISK_TTL_SECS"
	EnvAdmin         = "DYN_KVBM_ADMIN"
	EnvAdminDir      = "DYN_KVBM_ADMIN_DIR"
)

// CapTTL bounds both TTLs (ten years): a larger value is a typo, and the
// sweeper's cut-off (now minus the TTL) must stay a valid time.
const CapTTL = 10 * 365 * 24 * time.Hour

// Lifecycle is the expiry and operator-endpoint configuration.
type Lifecycle struct {
	// ObjectTTL: G4 objects older than this are deleted (0: never). A bucket
	// lifecycle rule does it where the server accepts one and the TTL is
	// whole days; otherwise the leader's sweeper, a bounded listing per pass.
	ObjectTTL time.Duration
	// DiskTTL: G3 blocks registered longer ago than this are dropped (0:
	// never), a bounded scan per pass.
	DiskTTL time.Duration
	// Admin turns on the leader's operator endpoint (a Unix socket, default
	// on); AdminDir is where its socket and token live ("" : the user's
	// runtime directory, see goext/admin.Dir).
	Admin    bool
	AdminDir string
}

// ttl parses a TTL in whole seconds: unset or 0 is off; at most CapTTL.
func (p *parser) ttl(name string) time.Duration {
	raw, set := p.get(name)
	if !set {
		return 0
	}
	n, ok := p.integer(name, 0)
	if !ok {
		return 0
	}
	if time.Duration(n) > CapTTL/time.Second {
		p.fail(name, raw, fmt.Sprintf("must be at most %d seconds (ten years)", int64(CapTTL/time.Second)))
		return 0
	}
	return time.Duration(n) * time.Second
}

func (p *parser) lifecycle() Lifecycle {
	return Lifecycle{
		ObjectTTL: p.ttl(EnvObjectTTLSecs),
		DiskTTL:   p.ttl(EnvDiskTTLSecs),
		Admin:     p.boolean(EnvAdmin, true),
		AdminDir:  p.adminDir(),
	}
}

// adminDir is DYN_KVBM_ADMIN_DIR, else $XDG_RUNTIME_DIR/kvbm (an absolute
// XDG_RUNTIME_DIR only), else "" (goext/admin then uses /tmp/kvbm-<uid>).
func (p *parser) adminDir() string {
	if d := p.path(EnvAdminDir, ""); d != "" {
		return d
	}
	if v, set := p.get("XDG_RUNTIME_DIR"); set && filepath.IsAbs(strings.TrimSpace(v)) {
		return filepath.Join(strings.TrimSpace(v), "kvbm")
	}
	return ""
}
