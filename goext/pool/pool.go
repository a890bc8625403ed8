// Package pool is the logical view of one kvbm tier (G2 host or G3 disk): which
// block index holds which sequence hash, which blocks are free, which are
// pinned, and which one to evict next. It never touches bytes; the worker owns
// those and follows the leader's plan.
//
// Block life cycle (design §4):
//
//	free ──Allocate──▶ allocated (refs=1, unregistered)
//	allocated ──Register──▶ registered (findable by sequence hash)
//	registered, refs>0  = active: pinned, never evicted
//	registered, refs==0 = inactive: findable, evictable by (priority, tick)
//	unregistered, refs==0 ──▶ back on the free list
//
// Eviction order: never-used (free) blocks first, then the inactive registered
// block with the lowest (priority, last-returned tick) — LRU within a
// priority. Inactive blocks sit in one intrusive LRU list per priority: a
// block's tick is assigned when it enters its list's tail, so each list is
// sorted by tick and the victim is the head of the lowest non-empty list.
// Pin, Release, Touch and eviction are O(1) (plus a search over the handful
// of distinct priorities); Match is one map lookup per hash. A heap would cost
// O(log n) per pin, and a 32K-token match pins 2,048 blocks.
//
// A Pool is not safe for concurrent use; the leader serialises access.
package pool

import (
	"fmt"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/plan"
)

// State is where a block is in its life cycle.
type State uint8

const (
	// Free: never used, or reset after eviction/invalidation; on the free list.
	Free State = iota
	// Allocated: handed out by Allocate, being written, not findable yet.
	Allocated
	// Registered: has a sequence hash and is findable through Match.
	Registered
)

func (s State) String() string {
	switch s {
	case Free:
		return "Free"
	case Allocated:
		return "Allocated"
	case Registered:
		return "Registered"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// block is one slot of the tier.
type block struct {
	seqHash uint64
	parent  uint64
	// tokens is an immutable copy made at Register; it is shared with the
	// store event and with a G3 registration of the same block, so it is
	// never written after creation.
	tokens    []uint32
	tick      uint64 // last-returned tick (LRU key within a priority)
	born      int64  // registration time, Unix ns (0 without a clock; scan.go)
	priority  int32
	refs      int32 // pins: staged loads, pending moves, the allocating caller
	prev      int32 // neighbours in the inactive list of its priority (-1: none)
	next      int32
	state     State
	hasParent bool
	linked    bool // in an inactive list
}

// lruList is the inactive blocks of one priority, oldest tick at head.
type lruList struct {
	priority   int32
	head, tail int32
}

// Pool is one tier's logical blocks.
type Pool struct {
	tier   plan.Tier
	holder events.Holder
	sink   events.Sink // nil when events are discarded

	blocks   []block
	registry map[uint64]int32 // sequence hash → block index
	free     []int32          // stack of free block indexes
	lists    []lruList        // inactive lists, ascending priority (kept when empty)
	inactive int              // blocks in the lists
	tick     uint64

	evictions uint64 // registered blocks evicted to make room (stats)

	clock func() int64 // stamps registrations (SetClock); nil: none
}

// New creates a pool of numBlocks free blocks for tier. Registrations and
// evictions are published to sink (nil or events.NopSink: none) as holder.
func New(tier plan.Tier, numBlocks int, sink events.Sink, holder events.Holder) *Pool {
	if numBlocks < 0 {
		numBlocks = 0
	}
	if _, nop := sink.(events.NopSink); nop {
		sink = nil
	}
	p := &Pool{
		tier:     tier,
		holder:   holder,
		sink:     sink,
		blocks:   make([]block, numBlocks),
		registry: make(map[uint64]int32, min(numBlocks, 1<<20)),
		free:     make([]int32, numBlocks),
	}
	// The free list is a stack; push in reverse so block 0 is handed out
	// first (deterministic plans, easier tests).
	for i := range numBlocks {
		p.free[i] = int32(numBlocks - 1 - i)
		p.blocks[i].prev, p.blocks[i].next = -1, -1
	}
	return p
}

// Tier is the tier this pool describes.
func (p *Pool) Tier() plan.Tier { return p.tier }

// Capacity is the number of blocks in the tier.
func (p *Pool) Capacity() int { return len(p.blocks) }

// NumRegistered is the number of findable blocks (active and inactive).
func (p *Pool) NumRegistered() int { return len(p.registry) }

// NumFree is the number of never-used or reset blocks.
func (p *Pool) NumFree() int { return len(p.free) }

// NumInactive is the number of registered blocks nobody pins (evictable).
func (p *Pool) NumInactive() int { return p.inactive }

// Evictions is how many registered blocks were evicted to make room so far.
func (p *Pool) Evictions() uint64 { return p.evictions }

// BlockInfo is a read-only view of one block, for the leader and tests.
type BlockInfo struct {
	State     State
	SeqHash   uint64
	Parent    uint64
	HasParent bool
	Tokens    []uint32 // shared and immutable: do not modify
	Priority  int
	Tick      uint64
	Refs      int
}

// Info describes block idx.
func (p *Pool) Info(idx int) BlockInfo {
	b := &p.blocks[idx]
	return BlockInfo{
		State: b.state, SeqHash: b.seqHash, Parent: b.parent, HasParent: b.hasParent,
		Tokens: b.tokens, Priority: int(b.priority), Tick: b.tick, Refs: int(b.refs),
	}
}

// Lookup returns the block registered under seqHash.
func (p *Pool) Lookup(seqHash uint64) (int, bool) {
	i, ok := p.registry[seqHash]
	return int(i), ok
}

// Holds reports whether block idx is registered under seqHash (a queued or
// recorded reference is still valid).
func (p *Pool) Holds(idx int, seqHash uint64) bool {
	if idx < 0 || idx >= len(p.blocks) {
		return false
	}
	b := &p.blocks[idx]
	return b.state == Registered && b.seqHash == seqHash
}

// Match appends to dst the block indexes of the longest contiguous prefix of
// hashes that is registered here and returns the extended slice. It stops at
// the first miss (design §4): a later hit after a gap is useless because the
// engine can only skip a prefix. Match neither pins nor touches.
func (p *Pool) Match(hashes []uint64, dst []int) []int {
	for _, h := range hashes {
		i, ok := p.registry[h]
		if !ok {
			break
		}
		dst = append(dst, int(i))
	}
	return dst
}

// MatchLen is Match without the indexes: the length of the matched prefix.
func (p *Pool) MatchLen(hashes []uint64) int {
	for n, h := range hashes {
		if _, ok := p.registry[h]; !ok {
			return n
		}
	}
	return len(hashes)
}

// Pin takes a reference on block idx so that it cannot be evicted (a staged
// load source, the source of a pending G2→G3 move). Pin an allocated or
// registered block only.
func (p *Pool) Pin(idx int) {
	b := &p.blocks[idx]
	if b.state == Free {
		panic(fmt.Sprintf("pool %s: pin of free block %d", p.tier, idx))
	}
	if b.linked {
		p.unlink(int32(idx))
	}
	b.refs++
}

// Unpin drops a reference taken by Pin or Allocate (same as Release).
func (p *Pool) Unpin(idx int) { p.Release(idx) }

// Release drops a reference. When the last one goes, a registered block
// becomes inactive (still findable, evictable, its tick set to "now") and an
// unregistered one goes back to the free list.
func (p *Pool) Release(idx int) {
	b := &p.blocks[idx]
	if b.refs <= 0 {
		panic(fmt.Sprintf("pool %s: release of unreferenced block %d (%s)", p.tier, idx, b.state))
	}
	b.refs--
	if b.refs > 0 {
		return
	}
	if b.state == Registered {
		p.pushTail(int32(idx))
		return
	}
	p.reset(int32(idx))
}

// Touch marks block idx as just used: its tick moves to "now", so it is the
// last of its priority to be evicted.
func (p *Pool) Touch(idx int) {
	b := &p.blocks[idx]
	if b.linked {
		p.unlink(int32(idx))
		p.pushTail(int32(idx))
		return
	}
	p.tick++
	b.tick = p.tick
}

// Allocate appends to dst up to n blocks ready to be written and returns the
// extended slice. Each returned block is Allocated with one reference held by
// the caller, who must Register or Release it. Free blocks go first; then the
// inactive registered block with the lowest (priority, tick) is evicted
// (REMOVE event). Pinned blocks are never evicted, so fewer than n blocks come
// back when the tier is full of pinned ones.
func (p *Pool) Allocate(n int, dst []int) []int {
	for ; n > 0; n-- {
		var idx int32
		switch {
		case len(p.free) > 0:
			idx = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		case p.inactive > 0:
			idx = p.victim()
			p.unlink(idx)
			p.unregister(idx)
			p.evictions++
		default:
			return dst
		}
		b := &p.blocks[idx]
		b.state = Allocated
		b.refs = 1
		dst = append(dst, int(idx))
	}
	return dst
}

// Register makes allocated block idx findable under seqHash with the given
// parent, tokens (copied) and priority, and publishes a store event. The
// caller keeps its reference. If seqHash is already registered in this tier
// (another request wrote the same block), the new block is freed, the caller
// gets a reference on the existing one instead, no event is published, and
// dup is true.
func (p *Pool) Register(idx int, seqHash, parent uint64, hasParent bool, tokens []uint32, priority int) (registered int, dup bool) {
	return p.register(idx, seqHash, parent, hasParent, tokens, priority, true)
}

// RegisterShared is Register for a tokens slice the caller guarantees is never
// modified again (for example the tokens of a G2 block being copied to G3):
// the pool keeps it without copying.
func (p *Pool) RegisterShared(idx int, seqHash, parent uint64, hasParent bool, tokens []uint32, priority int) (registered int, dup bool) {
	return p.register(idx, seqHash, parent, hasParent, tokens, priority, false)
}

// register is Register (copyTokens) and RegisterShared. Tokens are copied only
// when the block is really registered, not for a duplicate.
func (p *Pool) register(idx int, seqHash, parent uint64, hasParent bool, tokens []uint32, priority int, copyTokens bool) (int, bool) {
	b := &p.blocks[idx]
	if b.state != Allocated {
		panic(fmt.Sprintf("pool %s: register of block %d in state %s", p.tier, idx, b.state))
	}
	if j, ok := p.registry[seqHash]; ok {
		b.refs = 0
		p.reset(int32(idx))
		p.Pin(int(j))
		return int(j), true
	}
	if copyTokens {
		tokens = append([]uint32(nil), tokens...)
	}
	return idx, p.registerShared(idx, seqHash, parent, hasParent, tokens, priority)
}

func (p *Pool) registerShared(idx int, seqHash, parent uint64, hasParent bool, tokens []uint32, priority int) bool {
	b := &p.blocks[idx]
	b.state = Registered
	b.seqHash = seqHash
	b.parent = parent
	b.hasParent = hasParent
	b.tokens = tokens
	b.priority = int32(priority)
	if p.clock != nil {
		b.born = p.clock()
	}
	p.registry[seqHash] = int32(idx)
	if p.sink != nil {
		p.sink.Publish(events.BlockEvent{
			Holder: p.holder, SeqHash: seqHash, Parent: parent, HasParent: hasParent,
			Tokens: tokens, BlockSize: len(tokens),
		})
	}
	return false
}

// Invalidate drops seqHash from the registry (its bytes are bad, or the cache
// is being reset) and publishes a removal. An inactive block goes straight to
// the free list; a pinned one stays allocated until its last Release. It
// returns the block index and whether the hash was registered.
func (p *Pool) Invalidate(seqHash uint64) (int, bool) {
	i, ok := p.registry[seqHash]
	if !ok {
		return 0, false
	}
	b := &p.blocks[i]
	p.unregister(i)
	if b.refs == 0 {
		if b.linked {
			p.unlink(i)
		}
		p.reset(i)
	} else {
		b.state = Allocated
	}
	return int(i), true
}

// InvalidateAll invalidates every registered block (cache reset) and appends
// their indexes to dst.
func (p *Pool) InvalidateAll(dst []int) []int {
	for h := range p.registry {
		idx, _ := p.Invalidate(h)
		dst = append(dst, idx)
	}
	return dst
}

// unregister removes block i from the registry and publishes its removal. The
// block keeps its state; callers move it on.
func (p *Pool) unregister(i int32) {
	b := &p.blocks[i]
	delete(p.registry, b.seqHash)
	if p.sink != nil {
		p.sink.Publish(events.BlockEvent{Removed: true, Holder: p.holder, SeqHash: b.seqHash, BlockSize: len(b.tokens)})
	}
	b.tokens = nil
}

// reset returns block i to the free list.
func (p *Pool) reset(i int32) {
	p.blocks[i] = block{prev: -1, next: -1}
	p.free = append(p.free, i)
}

// listFor returns the inactive list of priority prio, creating it (in
// ascending order) when absent. There are only a few distinct priorities.
func (p *Pool) listFor(prio int32) *lruList {
	lo, hi := 0, len(p.lists)
	for lo < hi {
		m := (lo + hi) / 2
		if p.lists[m].priority < prio {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo == len(p.lists) || p.lists[lo].priority != prio {
		p.lists = append(p.lists, lruList{})
		copy(p.lists[lo+1:], p.lists[lo:])
		p.lists[lo] = lruList{priority: prio, head: -1, tail: -1}
	}
	return &p.lists[lo]
}

// pushTail stamps block i with a new tick and appends it to its priority's
// list: ticks only grow, so the list stays sorted by tick.
func (p *Pool) pushTail(i int32) {
	b := &p.blocks[i]
	p.tick++
	b.tick = p.tick
	l := p.listFor(b.priority)
	b.prev, b.next = l.tail, -1
	if l.tail >= 0 {
		p.blocks[l.tail].next = i
	} else {
		l.head = i
	}
	l.tail = i
	b.linked = true
	p.inactive++
}

func (p *Pool) unlink(i int32) {
	b := &p.blocks[i]
	l := p.listFor(b.priority)
	if b.prev >= 0 {
		p.blocks[b.prev].next = b.next
	} else {
		l.head = b.next
	}
	if b.next >= 0 {
		p.blocks[b.next].prev = b.prev
	} else {
		l.tail = b.prev
	}
	b.prev, b.next = -1, -1
	b.linked = false
	p.inactive--
}

// victim is the inactive block with the lowest (priority, tick). Call only
// when p.inactive > 0.
func (p *Pool) victim() int32 {
	for k := range p.lists {
		if h := p.lists[k].head; h >= 0 {
			return h
		}
	}
	panic("pool: victim with no inactive block")
}
