package node

import (
	"log/slog"

	"github.com/kvbm/kvbm/goext/admin"
	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/leader"
)

// startAdmin starts the leader's operator endpoint (goext/admin: `python -m
// kvbm purge|stats`) unless DYN_KVBM_ADMIN=false; Close stops it and
// removes its socket and token. The cache works without it: a failure is
// logged, not returned.
func (n *Leader) startAdmin(cfg *config.Config, l *leader.Leader, log *slog.Logger) {
	if !cfg.Lifecycle.Admin {
		return
	}
	s, err := admin.Start(cfg.Lifecycle.AdminDir, l, log)
	if err != nil {
		log.Warn("kvbm operator endpoint not started (python -m kvbm purge/stats cannot reach this engine)",
			"err", err, "setting", config.EnvAdminDir)
		return
	}
	n.closers.push(s.Close)
}
