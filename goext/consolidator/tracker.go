// Package consolidator merges the engine's KV events (G1) with kvbm's host
// (G2) and disk (G3) tier events into one stream for KV-aware routers
// (design §7): one STORE per logical block, one REMOVE when no holder has it
// any more.
package consolidator

import (
	"context"
	"fmt"
	"log/slog"
	"math/bits"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
)

// Engine names the engine whose G1 events the consolidator receives; it
// only changes how the engine holder is named in log lines.
type Engine uint8

const (
	EngineVllm   Engine = iota // vLLM (default)
	EngineTrtllm               // TensorRT-LLM
	EngineSglang               // SGLang (its G1 and its HiCache host tier; kvbm as HiCache storage)
)

func (e Engine) String() string {
	switch e {
	case EngineTrtllm:
		return "Trtllm"
	case EngineSglang:
		return "Sglang"
	}
	return "Vllm"
}

// numHolders bounds events.Holder values (1..5) for the per-holder arrays.
const numHolders = 6

// extEntry maps one external hash to its block.
type extEntry struct {
	key uint64 // the block's dedup key
	// holders is the set (bit per events.Holder) of holders that stored the
	// block under this external hash. kvbm's host and disk tiers share
	// their external hash (kvbm's sequence hash), so one entry can serve
	// both; it is deleted when its last holder removes it.
	holders uint8
	// next is the block's next external hash (see block.exts); the chain
	// lives in the map so that it costs no allocation.
	next uint64
}

// block is one logical block, by dedup key.
type block struct {
	key   uint64 // its dedup key (in Tracker.blocks)
	first uint64 // the external hash the router was told in the STORE
	// exts is the number of external hashes whose extEntry names this
	// block, chained from extHead through extEntry.next, so that evicting
	// the block can drop them. Usually one or two: the engine's hash and
	// kvbm's.
	extHead uint64
	exts    uint32
	// older and newer link the blocks from Tracker.oldest to
	// Tracker.newest, by the time a holder last stored them.
	older, newer *block
	// refs counts, per holder, the external hashes through which that
	// holder holds the block. It is a count rather than a flag because an
	// engine can cache identical content at the same position under two
	// external hashes (e.g. two cache salts: vLLM's hashes differ, the
	// router key does not); the block stays until the last one goes.
	refs [numHolders]uint32
}

func (b *block) holders() (set uint8) {
	for h := 1; h < numHolders; h++ {
		if b.refs[h] > 0 {
			set |= 1 << h
		}
	}
	return set
}

// Tracker is the deduplication state machine of design §7.2. It is not safe
// for concurrent use: the Consolidator serialises all calls under its lock.
//
// Its memory is bounded: beyond maxBlocks logical blocks it forgets the
// one stored longest ago (queueing a REMOVE, so that the router forgets it
// too). Without the bound, every REMOVE the engine or kvbm failed to
// deliver would leak a block for the life of the process.
//
// Improvements over the reference: kvbm's host and disk tiers are separate
// holders (evicting one tier's copy never removes a block the other still
// has), holders are reference-counted per external hash, and the dedup key
// includes the LoRA adapter as the router's own hash does (the reference
// ignores it, so identical tokens under two adapters collide).
type Tracker struct {
	name  Engine // how the engine holder (events.HolderEngine) is named in logs
	log   *slog.Logger
	debug bool // log.Enabled(debug) at construction; avoids formatting on the hot path

	blocks map[uint64]*block   // dedup key → block
	ext    map[uint64]extEntry // external hash → key and holders
	firsts map[uint64]uint64   // a live block's first hash → its key
	queue  []events.ConsolidatedEvent
	groups map[int]string // the engine's KV cache groups: index → attention kind (groups.go)
	// pending holds the by-hash stores (sglang.go) of blocks the engine has
	// not announced yet: external hash → holders, oldest first in order.
	pending      map[uint64]uint8
	pendingOrder []uint64

	maxBlocks      int    // len(blocks) never exceeds it
	oldest, newest *block // ends of the age list (nil when empty)

	// warn rate-limits the warnings about input that names untracked
	// blocks or unknown holders: after an eviction or a lost STORE, every
	// later REMOVE of those blocks is one.
	warn *warnLimiter

	// Stats (monotonic).
	stores, removes, clears uint64
	deduped                 uint64 // stores and removes absorbed without an event
	unknownRemoves          uint64 // removes of hashes or holders not tracked (warned)
	evicted                 uint64 // blocks forgotten at maxBlocks (each with a REMOVE)
}

// DefaultMaxTrackedBlocks is the default cap on the logical blocks a
// Tracker holds: at a few hundred bytes each, about a gigabyte; room for
// the G1, host and disk tiers of a large deployment.
const DefaultMaxTrackedBlocks = 4 << 20

// TrackerOption configures NewTracker.
type TrackerOption func(*Tracker)

// WithMaxBlocks caps the logical blocks tracked (n > 0; otherwise
// DefaultMaxTrackedBlocks).
func WithMaxBlocks(n int) TrackerOption {
	return func(t *Tracker) {
		if n > 0 {
			t.maxBlocks = n
		}
	}
}

// NewTracker returns an empty tracker. logger may be nil (discard).
func NewTracker(engine Engine, logger *slog.Logger, opts ...TrackerOption) *Tracker {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	t := &Tracker{
		name:      engine,
		log:       logger,
		debug:     logger.Enabled(context.Background(), slog.LevelDebug),
		blocks:    make(map[uint64]*block),
		ext:       make(map[uint64]extEntry),
		firsts:    make(map[uint64]uint64),
		maxBlocks: DefaultMaxTrackedBlocks,
	}
	t.warn = newWarnLimiter(logger, "untracked-block")
	for _, o := range opts {
		o(t)
	}
	return t
}

// holderName renders a holder as the log lines of design §7.2 do: the engine
// as Vllm or Trtllm, kvbm's tiers as KvbmHost and KvbmDisk.
func (t *Tracker) holderName(h events.Holder) string {
	if h == events.HolderEngine {
		return t.name.String()
	}
	return h.String()
}

func validHolder(h events.Holder) bool {
	return (h >= events.HolderEngine && h <= events.HolderKvbmDisk) || h == events.HolderEngineHost
}

// Key returns the dedup key of a block: the router sequence hash (design §3)
// of its tokens chained onto its parent's key, or its local hash when the
// parent is absent or not tracked (an unknown parent keys the block as a
// first block, as the reference does).
func (t *Tracker) Key(tokens []uint32, lora string, parentExt uint64, hasParent bool) (key, local uint64) {
	local = hashing.RouterLocalHash(tokens, lora)
	if hasParent {
		if pe, ok := t.ext[parentExt]; ok {
			return hashing.RouterSequenceHash(pe.key, local), local
		}
	}
	return local, local
}

// Store records that holder h caches the block with external hash ext.
// It queues a STORE and returns true only when no holder had the block
// before. tokens are copied when queued; the caller may reuse them.
func (t *Tracker) Store(ext uint64, h events.Holder, tokens []uint32, parentExt uint64, hasParent bool,
	blockSize int, lora string) bool {
	if !validHolder(h) {
		t.warn.Warn(fmt.Sprintf("Ignoring store of block %d from unknown holder %d", ext, uint8(h)))
		return false
	}
	bit := uint8(1) << h

	// A known external hash names the same block whatever its parent's
	// state now: hashes are derived from the content and its whole prefix.
	// Recomputing would go wrong once the parent has been evicted (kvbm's
	// LRU can drop a parent from G2 before its child is copied to G3), so
	// the mapping wins.
	if e, ok := t.ext[ext]; ok {
		b := t.blocks[e.key]
		if e.holders&bit != 0 {
			t.deduped++
			if t.debug {
				t.log.Debug(fmt.Sprintf("Block %d (seq_hash=%d) already in source %s, external_hash=%d",
					b.first, e.key, t.holderName(h), ext))
			}
			return false
		}
		e.holders |= bit
		t.ext[ext] = e
		t.addRef(b, e.key, h, ext, len(tokens))
		return false
	}

	// The router still indexes a live block under its first hash even
	// after the holder that sent it dropped it (say kvbm's host tier
	// evicted it while the engine keeps it under its own hash). The same
	// hash coming back names that block: publishing a second STORE of it
	// would be a duplicate for the router, whatever the parent's state.
	if key, ok := t.firsts[ext]; ok {
		b := t.blocks[key]
		t.addExt(b, key, ext, bit)
		t.addRef(b, key, h, ext, len(tokens))
		t.adoptPending(b, key, ext)
		return false
	}

	key, local := t.Key(tokens, lora, parentExt, hasParent)
	if b, ok := t.blocks[key]; ok {
		t.addExt(b, key, ext, bit)
		t.addRef(b, key, h, ext, len(tokens))
		t.adoptPending(b, key, ext)
		return false
	}

	ev := events.ConsolidatedEvent{Kind: events.KindStored, BlockHash: ext,
		TokenIDs: append([]uint32(nil), tokens...), BlockSize: blockSize, LoraName: lora, TokensHash: local}
	// The router knows a block only by the hash it was first told, so the
	// parent is named by its first hash, not by this holder's hash of it.
	// Resolved before ext is mapped, so that a block naming itself as its
	// parent is published as a first block, never as its own child.
	if hasParent {
		if pe, ok := t.ext[parentExt]; ok {
			ev.ParentHash, ev.HasParent = t.blocks[pe.key].first, true
		}
	}

	b := &block{key: key, first: ext}
	b.refs[h] = 1
	t.blocks[key] = b
	t.firsts[ext] = key
	t.addExt(b, key, ext, bit)
	t.pushNewest(b)
	t.queue = append(t.queue, ev)
	t.stores++
	t.adoptPending(b, key, ext)
	if t.debug {
		t.log.Debug(fmt.Sprintf("Block %d (seq_hash=%d) stored in first source %s, will publish STORE event (total tracked: %d, hash_mapping: %d)",
			ext, key, t.holderName(h), len(t.blocks), len(t.ext)))
	}
	if len(t.blocks) > t.maxBlocks {
		t.evictOldest()
	}
	return true
}

// evictOldest forgets the block stored longest ago and every external hash
// of it, and queues its REMOVE. Its holders may still have it; their later
// REMOVEs are then unknown (warned, rate-limited), and a new STORE of it is
// published as a new block.
func (t *Tracker) evictOldest() {
	b := t.oldest
	t.unlink(b)
	for x, n := b.extHead, b.exts; n > 0; n-- {
		next := t.ext[x].next
		delete(t.ext, x)
		x = next
	}
	delete(t.blocks, b.key)
	delete(t.firsts, b.first)
	t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindRemoved, BlockHash: b.first})
	t.evicted++
	if t.evicted == 1 {
		t.log.Warn(fmt.Sprintf("KV event consolidator tracks %d blocks, its cap: forgetting the oldest (block %d) and "+
			"publishing REMOVE for each block it forgets; further evictions are counted in kvbm_consolidator_blocks_evicted",
			t.maxBlocks, b.first))
	}
}

// addExt maps the new external hash x to block b (dedup key key).
func (t *Tracker) addExt(b *block, key, x uint64, holders uint8) {
	t.ext[x] = extEntry{key: key, holders: holders, next: b.extHead}
	b.extHead = x
	b.exts++
}

// dropExt deletes the mapping of external hash x, one of b's.
func (t *Tracker) dropExt(b *block, x uint64) {
	next := t.ext[x].next
	delete(t.ext, x)
	b.exts--
	if b.extHead == x {
		b.extHead = next
		return
	}
	for p, n := b.extHead, b.exts; n > 0; n-- {
		e := t.ext[p]
		if e.next == x {
			e.next = next
			t.ext[p] = e
			return
		}
		p = e.next
	}
}

// pushNewest links b as the newest block.
func (t *Tracker) pushNewest(b *block) {
	b.older, b.newer = t.newest, nil
	if t.newest != nil {
		t.newest.newer = b
	} else {
		t.oldest = b
	}
	t.newest = b
}

// unlink takes b out of the age list.
func (t *Tracker) unlink(b *block) {
	if b.older != nil {
		b.older.newer = b.newer
	} else {
		t.oldest = b.newer
	}
	if b.newer != nil {
		b.newer.older = b.older
	} else {
		t.newest = b.older
	}
	b.older, b.newer = nil, nil
}

// addRef adds a reference from holder h to an existing block (a
// deduplicated store).
func (t *Tracker) addRef(b *block, key uint64, h events.Holder, ext uint64, ntok int) {
	b.refs[h]++
	t.deduped++
	if b != t.newest { // a fresh store makes it the last to evict
		t.unlink(b)
		t.pushNewest(b)
	}
	if t.debug && b.refs[h] == 1 {
		t.log.Debug(fmt.Sprintf("DEDUP: Block %d (seq_hash=%d) added to source %s (already exists in %d source(s), %d tokens, external_hash=%d)",
			b.first, key, t.holderName(h), bits.OnesCount8(b.holders())-1, ntok, ext))
	}
}

// Remove records that holder h evicted the block with external hash ext.
// It queues a REMOVE (under the block's first hash) and returns true only
// when no holder has the block any more.
func (t *Tracker) Remove(ext uint64, h events.Holder) bool {
	e, ok := t.ext[ext]
	if !ok {
		if t.dropPending(ext, h) {
			return false
		}
		t.unknownRemoves++
		t.warn.Warn(fmt.Sprintf("Attempted to remove unknown block %d from source %s (not in hash_mapping)", ext, t.holderName(h)))
		return false
	}
	bit := uint8(1) << h
	if !validHolder(h) || e.holders&bit == 0 {
		t.unknownRemoves++
		t.warn.Warn(fmt.Sprintf("Attempted to remove source %s from block %d but it wasn't present", t.holderName(h), ext))
		return false
	}
	b := t.blocks[e.key]
	if e.holders &^= bit; e.holders == 0 {
		t.dropExt(b, ext)
	} else {
		t.ext[ext] = e
	}
	b.refs[h]--
	if set := b.holders(); set != 0 {
		t.deduped++
		if t.debug {
			t.log.Debug(fmt.Sprintf("Block %d (seq_hash=%d) removed from source %s, still in %d source(s) (hash_mapping: %d)",
				b.first, e.key, t.holderName(h), bits.OnesCount8(set), len(t.ext)))
		}
		return false
	}
	// Every extEntry pointing at the key held a reference, so with none
	// left no mapping to the block remains: nothing stray to purge.
	delete(t.blocks, e.key)
	delete(t.firsts, b.first)
	t.unlink(b)
	t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindRemoved, BlockHash: b.first})
	t.removes++
	if t.debug {
		t.log.Debug(fmt.Sprintf("Block %d (seq_hash=%d) removed from last source %s, will publish REMOVE event (total tracked: %d, hash_mapping: %d)",
			b.first, e.key, t.holderName(h), len(t.blocks), len(t.ext)))
	}
	return true
}

// ClearAll forgets every block and queues CLEAR (design §7.2). kvbm's later
// removals of blocks it still held are then warned about as unknown, and
// its re-registrations published as new STOREs, as in the reference.
func (t *Tracker) ClearAll() {
	clear(t.blocks)
	clear(t.ext)
	clear(t.firsts)
	t.clearPending(0)
	t.oldest, t.newest = nil, nil
	t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindCleared})
	t.clears++
	if t.debug {
		t.log.Debug("All blocks cleared, will publish CLEAR event")
	}
}

// ClearHolder drops holder h as a holder of every block (the engine's
// AllBlocksCleared, or a reset of one of kvbm's tiers), design §7.2: blocks
// no other holder keeps are removed, each with a REMOVE under its first
// hash, so the router keeps the blocks kvbm can still onboard. When no other
// holder keeps anything, it is ClearAll: one CLEAR.
func (t *Tracker) ClearHolder(h events.Holder) {
	if !validHolder(h) {
		return
	}
	bit := uint8(1) << h
	t.clearPending(bit)
	others := false
	for _, b := range t.blocks {
		if b.holders()&^bit != 0 {
			others = true
			break
		}
	}
	if !others {
		t.ClearAll()
		return
	}
	removed := 0
	for key, b := range t.blocks {
		if b.refs[h] == 0 {
			continue
		}
		for x, n := b.extHead, b.exts; n > 0; n-- {
			e := t.ext[x]
			next := e.next
			if e.holders&bit != 0 {
				if e.holders &^= bit; e.holders == 0 {
					t.dropExt(b, x)
				} else {
					t.ext[x] = e
				}
			}
			x = next
		}
		b.refs[h] = 0
		if b.holders() != 0 {
			t.deduped++
			continue
		}
		delete(t.blocks, key)
		delete(t.firsts, b.first)
		t.unlink(b)
		t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindRemoved, BlockHash: b.first})
		t.removes++
		removed++
		if t.debug {
			t.log.Debug(fmt.Sprintf("Block %d (seq_hash=%d) removed from last source %s, will publish REMOVE event (cleared)",
				b.first, key, t.holderName(h)))
		}
	}
	if t.debug {
		t.log.Debug(fmt.Sprintf("Source %s cleared all its blocks: %d removed from their last source (REMOVE events), "+
			"%d still held by other sources (no CLEAR)", t.holderName(h), removed, len(t.blocks)))
	}
}

// ApplyEngine feeds one decoded engine event (holder: the engine; SGLang's
// host tier events: events.HolderEngineHost).
func (t *Tracker) ApplyEngine(ev *events.EngineEvent) {
	if t.otherGroup(ev) {
		return
	}
	holder := t.engineHolder(ev)
	switch ev.Kind {
	case events.KindStored:
		for i, h := range ev.BlockHashes {
			p, hp := ev.Parent(i)
			t.Store(h, holder, ev.Block(i), p, hp, ev.BlockSize, ev.LoraName)
		}
	case events.KindRemoved:
		for _, h := range ev.BlockHashes {
			t.Remove(h, holder)
		}
	case events.KindCleared:
		t.ClearHolder(events.HolderEngine)
		if t.name == EngineSglang {
			t.ClearHolder(events.HolderEngineHost)
		}
	}
}

// Forward queues the engine event ev as it is, one event per block, without
// tracking it (ModePassthrough).
func (t *Tracker) Forward(ev *events.EngineEvent) {
	switch ev.Kind {
	case events.KindStored:
		for i, h := range ev.BlockHashes {
			p, hp := ev.Parent(i)
			tokens := ev.Block(i)
			t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindStored, BlockHash: h,
				ParentHash: p, HasParent: hp, TokenIDs: append([]uint32(nil), tokens...), BlockSize: ev.BlockSize,
				LoraName: ev.LoraName, TokensHash: hashing.RouterLocalHash(tokens, ev.LoraName)})
			t.stores++
		}
	case events.KindRemoved:
		for _, h := range ev.BlockHashes {
			t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindRemoved, BlockHash: h})
			t.removes++
		}
	case events.KindCleared:
		t.queue = append(t.queue, events.ConsolidatedEvent{Kind: events.KindCleared})
		t.clears++
	}
}

// ApplyKvbm feeds one kvbm tier event: its external hash is kvbm's
// sequence hash, its parent the parent's sequence hash.
func (t *Tracker) ApplyKvbm(ev *events.BlockEvent) {
	if ev.ByHash && !ev.Removed {
		t.StoreByHash(ev.SeqHash, ev.Holder)
		return
	}
	if ev.Removed {
		t.Remove(ev.SeqHash, ev.Holder)
		return
	}
	t.Store(ev.SeqHash, ev.Holder, ev.Tokens, ev.Parent, ev.HasParent, ev.BlockSize, ev.LoraName)
}

// Drain appends the queued events to dst, empties the queue and returns the
// extended slice.
func (t *Tracker) Drain(dst []events.ConsolidatedEvent) []events.ConsolidatedEvent {
	dst = append(dst, t.queue...)
	clear(t.queue) // drop token slices for the GC
	t.queue = t.queue[:0]
	return dst
}

// Queued is the number of events waiting to be drained.
func (t *Tracker) Queued() int { return len(t.queue) }

// Len is the number of logical blocks tracked.
func (t *Tracker) Len() int { return len(t.blocks) }

// Evicted is the number of blocks forgotten at the cap (monotonic).
func (t *Tracker) Evicted() uint64 { return t.evicted }

// FlushWarnings logs the summary of warnings suppressed so far (Close).
func (t *Tracker) FlushWarnings() { t.warn.Flush() }

// Holders returns the holders of the block with external hash ext (nil if
// not tracked), for tests and diagnostics.
func (t *Tracker) Holders(ext uint64) []events.Holder {
	e, ok := t.ext[ext]
	if !ok {
		return nil
	}
	var out []events.Holder
	set := t.blocks[e.key].holders()
	for h := events.HolderEngine; h < numHolders; h++ {
		if set&(1<<h) != 0 {
			out = append(out, h)
		}
	}
	return out
}
