package consolidator

import (
	"fmt"
	"strings"

	"github.com/kvbm/kvbm/goext/events"
)

// SGLang (docs/design.md §6.3, §7): its scheduler publishes KV events for
// its own cache, in the encoding vLLM uses (msgpack [ts, events, dp_rank],
// events as tagged maps), with medium "GPU" for its device cache and
// "CPU_PINNED" for HiCache's host tier (L2). kvbm, as HiCache's storage
// (L3), sees only SGLang's page keys, never tokens: its disk tier's events
// name each page by the hash SGLang's events use for it (ByHash) and join
// the engine's block of that hash.

// sglangHostMedium is the medium of SGLang's HiCache host tier events.
const sglangHostMedium = "CPU_PINNED"

// engineHolder is the holder an engine event speaks for: SGLang's host tier
// is a holder of its own, everything else the engine's G1.
func (t *Tracker) engineHolder(ev *events.EngineEvent) events.Holder {
	if t.name == EngineSglang && strings.EqualFold(ev.Medium, sglangHostMedium) {
		return events.HolderEngineHost
	}
	return events.HolderEngine
}

// fromEngine reports whether the consolidator applies an event of the
// engine's stream: its G1 (engineTier) and, for SGLang in dedup mode, its
// host tier. In passthrough mode the router sees the engine's G1 only.
func (c *Consolidator) fromEngine(ev *events.EngineEvent) bool {
	if engineTier(ev) {
		return true
	}
	return c.cfg.Engine == EngineSglang && c.cfg.Mode == ModeDedup && strings.EqualFold(ev.Medium, sglangHostMedium)
}

// StoreByHash records that holder h caches the engine's block with external
// hash ext, without tokens (events.BlockEvent.ByHash). A block the tracker
// knows gains the holder (no event: the router has it). A block it does not
// know yet waits in pending until the engine stores it (its STORE then
// carries the tokens), and is dropped from there by the holder's REMOVE:
// without tokens the router could not match it to a prompt. pending is
// bounded like the blocks: beyond maxBlocks the oldest entry is forgotten.
func (t *Tracker) StoreByHash(ext uint64, h events.Holder) {
	if !validHolder(h) || h == events.HolderEngine {
		t.warn.Warn(fmt.Sprintf("Ignoring by-hash store of block %d from holder %d", ext, uint8(h)))
		return
	}
	bit := uint8(1) << h
	if e, ok := t.ext[ext]; ok {
		if e.holders&bit != 0 {
			t.deduped++
			return
		}
		e.holders |= bit
		t.ext[ext] = e
		t.addRef(t.blocks[e.key], e.key, h, ext, 0)
		return
	}
	if key, ok := t.firsts[ext]; ok {
		b := t.blocks[key]
		t.addExt(b, key, ext, bit)
		t.addRef(b, key, h, ext, 0)
		return
	}
	if t.pending == nil {
		t.pending = make(map[uint64]uint8)
	}
	set, had := t.pending[ext]
	t.pending[ext] = set | bit
	t.deduped++
	if had {
		return
	}
	t.pendingOrder = append(t.pendingOrder, ext)
	for len(t.pending) > t.maxBlocks && len(t.pendingOrder) > 0 {
		old := t.pendingOrder[0]
		t.pendingOrder = t.pendingOrder[1:]
		delete(t.pending, old)
	}
	if len(t.pendingOrder) > 2*len(t.pending)+64 { // compact the stale entries
		kept := t.pendingOrder[:0]
		for _, x := range t.pendingOrder {
			if _, ok := t.pending[x]; ok {
				kept = append(kept, x)
			}
		}
		t.pendingOrder = kept
	}
}

// adoptPending gives block b (now mapped from ext) the holders whose
// by-hash stores of ext were waiting.
func (t *Tracker) adoptPending(b *block, key, ext uint64) {
	set, ok := t.pending[ext]
	if !ok {
		return
	}
	delete(t.pending, ext)
	e := t.ext[ext]
	for h := events.Holder(1); h < numHolders; h++ {
		bit := uint8(1) << h
		if set&bit == 0 || e.holders&bit != 0 {
			continue
		}
		e.holders |= bit
		t.ext[ext] = e
		t.addRef(b, key, h, ext, 0)
	}
}

// dropPending removes holder h from a waiting by-hash store of ext; false
// when there was none.
func (t *Tracker) dropPending(ext uint64, h events.Holder) bool {
	set, ok := t.pending[ext]
	bit := uint8(1) << h
	if !ok || set&bit == 0 {
		return false
	}
	if set &^= bit; set == 0 {
		delete(t.pending, ext)
	} else {
		t.pending[ext] = set
	}
	t.deduped++
	return true
}

// clearPending drops the holders in bits (0: all) from the waiting stores.
func (t *Tracker) clearPending(bits uint8) {
	if bits == 0 {
		clear(t.pending)
		t.pendingOrder = t.pendingOrder[:0]
		return
	}
	for x, set := range t.pending {
		if set &^= bits; set == 0 {
			delete(t.pending, x)
		} else {
			t.pending[x] = set
		}
	}
}

// Pending is the number of by-hash stores waiting for the engine's STORE.
func (t *Tracker) Pending() int { return len(t.pending) }
