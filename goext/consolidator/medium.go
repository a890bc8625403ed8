package consolidator

import (
	"strings"

	"github.com/kvbm/kvbm/goext/events"
)

// engineTier reports whether an event of the engine's stream is about the
// engine's own G1 (medium "GPU", or none named). The stream also carries
// other tiers' events under the engine's hashes, medium "CPU" or "STORAGE":
// kvbm's G2/G3 when the vLLM adapter publishes them there (the consolidator
// gets those in-process, as kvbm's holders), or the engine's own offloading.
// Taken as the engine's, they would make the engine a holder of blocks only
// another tier keeps; they are skipped and counted in Stats.NotForwarded.
func engineTier(ev *events.EngineEvent) bool {
	return ev.Kind == events.KindCleared || ev.Medium == "" || strings.EqualFold(ev.Medium, "GPU")
}
