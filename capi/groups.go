package main

import (
	"fmt"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/worker"
)

// checkGroupsCopier refuses KV cache groups on device memory: the CUDA
// copier moves whole blocks of one block table (goext/cuda), not a block per
// group. It closes g1c when it refuses.
func checkGroupsCopier(eng *layout.Engine, g1c worker.G1Copier) error {
	if g1c == nil || eng.NumGroups() <= 1 {
		return nil
	}
	_ = g1c.Close()
	return withCode(statusConfig, fmt.Errorf("kvbm_worker_new: %d KV cache groups (layer groups %v) on device memory: "+
		"the CUDA copier does not copy per KV cache group yet (host-memory KV caches do)", eng.NumGroups(), eng.LayerGroups()))
}
