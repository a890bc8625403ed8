package consolidator

import "github.com/kvbm/kvbm/goext/events"

// With vLLM's hybrid KV cache manager the engine publishes every KV cache
// group's blocks under the same external hash per position. What a router
// matches is a cached prefix, which only a full-attention group keeps whole:
// a sliding-window group frees the blocks before its window (vLLM removes
// them long before the full group's), so its REMOVE would withdraw a block
// the engine still serves. The tracker therefore follows the full-attention
// groups only, learning each group's kind from its stores (vLLM sends the
// kind on stores, the index alone on removes). Events without a group, or of
// a group whose kind is not known yet, are applied as before.

// otherGroup reports whether ev comes from a group the tracker does not follow.
func (t *Tracker) otherGroup(ev *events.EngineEvent) bool {
	if !ev.HasGroup {
		return false
	}
	if ev.Kind == events.KindStored && ev.GroupKind != "" {
		if t.groups == nil {
			t.groups = make(map[int]string)
		}
		t.groups[ev.Group] = ev.GroupKind
	}
	kind, ok := t.groups[ev.Group]
	return ok && !events.FullAttentionKind(kind)
}
