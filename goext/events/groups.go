package events

import (
	"math"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// vLLM's hybrid KV cache manager publishes each KV cache group's blocks:
// BlockStored carries group_idx and kv_cache_spec_kind (array indexes 9 and
// 10, after extra_keys), BlockRemoved group_idx (index 3). A position's
// external hash is the same in every group.

// storedGroupFields reads a BlockStored array's fields from index 8
// (extra_keys, skipped) on: group_idx, kv_cache_spec_kind, and skips the rest.
func (dec *Decoder) storedGroupFields(n int) error {
	if err := dec.skip(1); err != nil { // extra_keys
		return err
	}
	if n > 9 {
		if err := dec.groupField(); err != nil {
			return err
		}
	}
	if n > 10 {
		var err error
		if dec.ev.groupKind, err = dec.optStr("kv_cache_spec_kind", true); err != nil {
			return err
		}
	}
	return dec.skip(n - 11)
}

// groupField reads group_idx: an int, or nil (no group). Anything else is
// skipped, not an error: a publisher other than vLLM may put another field
// at that index, and the group only refines how the event is tracked.
func (dec *Decoder) groupField() error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if c == msgpcode.Nil {
		return dec.d.DecodeNil()
	}
	if !isInt(c) {
		return dec.skip(1)
	}
	v, err := dec.d.DecodeInt64()
	if err != nil || v < 0 || v > math.MaxInt32 {
		return err
	}
	dec.ev.group, dec.ev.hasGroup = v, true
	return nil
}

// FullAttentionKind reports whether a group of this kind holds every block
// of a cached prefix (full attention, MLA), which is what a router's prefix
// match means; a sliding-window or chunked-local group frees the blocks
// before its window, a state group keeps state, not per-position KV.
func FullAttentionKind(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}
