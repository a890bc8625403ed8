package main

import (
	"log/slog"

	"github.com/kvbm/kvbm/goext/admin"
	"github.com/kvbm/kvbm/goext/config"
)

// startAdmin starts the leader's operator endpoint (goext/admin: `python -m
// kvbm purge|stats`) unless DYN_KVBM_ADMIN=false. The cache works without
// it: a failure is logged, not returned.
func (h *leaderHandle) startAdmin(cfg *config.Config, log *slog.Logger) {
	if !cfg.Lifecycle.Admin || h.l == nil {
		return
	}
	s, err := admin.Start(cfg.Lifecycle.AdminDir, h.l, log)
	if err != nil {
		log.Warn("kvbm operator endpoint not started (python -m kvbm purge/stats cannot reach this engine)",
			"err", err, "setting", config.EnvAdminDir)
		return
	}
	h.admin = s
}

// stopAdmin stops the endpoint and removes its socket and token.
func (h *leaderHandle) stopAdmin() {
	if h.admin != nil {
		h.admin.Close()
		h.admin = nil
	}
}
