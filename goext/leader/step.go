package leader

import (
	"cmp"
	"container/heap"
	"fmt"
	"slices"
	"time"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

// RequestUpdate is what the engine scheduled for one request in this step.
type RequestUpdate struct {
	ReqID string
	// NewTokens: on the request's first Step and on a Resumed update, all its
	// tokens so far (the prompt; plus generated tokens when resumed);
	// otherwise the tokens appended since the last update (may be empty).
	NewTokens []uint32
	// NewBlockIDs: G1 block ids appended since the last update. A list that
	// repeats the ids already known (whole-list resends) is deduplicated.
	NewBlockIDs []int64
	// NumComputedTokens: tokens whose KV is in G1 before this step (G1 hit,
	// loaded tokens, earlier chunks).
	NumComputedTokens int
	// NumScheduledTokens: tokens this step computes.
	NumScheduledTokens int
	// Priorities: the priority of each of NewBlockIDs (Priorities[i] is
	// NewBlockIDs[i]'s), for the eviction order of its saved copies and the
	// offload filter (DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY). A block past
	// the end of the list (every block when nil) has no priority: the filter
	// lets it through and its copies are registered at priority 0.
	Priorities []int
	// Salt is the request's salt hash (hashing.SaltHash), read when the slot
	// is created; 0 = the default salt.
	Salt uint64
	// Resumed: the request was preempted and is scheduled again; its block
	// list is replaced by NewBlockIDs.
	Resumed bool
	// KnownTokens: NewTokens follow the first KnownTokens tokens the leader
	// got from GetNumNewMatchedTokens for this request (a first or Resumed
	// update; 0: NewTokens are all of them). Each token thus reaches the
	// leader once. A leader that no longer has them (the request was
	// forgotten since) does not offload the request.
	KnownTokens int
	// Groups: with Options.Groups, the blocks of every KV cache group
	// (groups.go); nil when the update adds none.
	Groups *GroupBlocks
}

// Step plans one engine step and returns the encoded plan.Step for the
// workers. In order:
//
//   - Loads: every load planned by UpdateStateAfterAlloc since the last Step
//     (requests waiting for their load are not in updates).
//   - Moves: queued G2→G3 copies (registered in earlier steps), highest
//     priority first, FIFO within a priority; each G2 source is pinned while
//     planning so this step's saves cannot take it (workers run Moves before
//     Saves). With Options.Background none: PlanBackground hands them out.
//     Degraded (SetDegraded): no moves and no saves.
//   - Saves (write-through): for each update, every block that is full after
//     this step (computed+scheduled tokens, tokens known, G1 block known) and
//     not evaluated yet is copied G1→G2 (G1→G3 in disk-only mode) and
//     registered; a block whose hash the tier already has is not copied again
//     but counts as a re-registration for the disk frequency filter. The
//     priority filter (design §4) offloads the longest prefix of blocks whose
//     priority is at least DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY and
//     stops the request's offload for good at its first block below it.
//   - Drops: blocks invalidated since the last Step and not rewritten by it.
//
// Cost is O(blocks that changed) plus the queued moves; nothing walks a pool.
func (l *Leader) Step(updates []RequestUpdate) ([]byte, error) {
	defer l.wakeSideChannel() // background loop: new saves may be ready to move
	l.mu.Lock()
	defer l.unlock()
	l.seq++
	l.saveRetry = false
	st := plan.Step{Seq: l.seq}
	now := l.now()

	l.observeStep(now, updates)
	l.g4ReleaseUploaded()
	l.emitLoads(&st)
	l.planMoves(&st)
	l.flushAdmittedUploads(&st)
	for i := range updates {
		l.applyUpdate(&updates[i], &st, now)
	}
	l.ageOut(now) // after the updates: a request in this step is never idle

	// The step is planned: workers will execute its Moves before its Saves,
	// and both before the next step, so the step's pins can go.
	for _, tb := range l.written {
		l.poolOf(tb.tier).Release(tb.idx)
	}
	l.written = l.written[:0]
	for _, idx := range l.moveSrc {
		l.host.Unpin(idx)
	}
	l.moveSrc = l.moveSrc[:0]

	if len(l.drops) > 0 {
		st.Drops = make([]plan.Copy, 0, len(l.drops))
		for tb := range l.drops {
			st.Drops = append(st.Drops, plan.Copy{Src: tb.tier, SrcBlock: int64(tb.idx)})
		}
		slices.SortFunc(st.Drops, func(a, b plan.Copy) int {
			return cmp.Or(cmp.Compare(a.Src, b.Src), cmp.Compare(a.SrcBlock, b.SrcBlock))
		})
		clear(l.drops)
	}

	if l.groups != nil {
		l.addGroupRows(&st, updates)
	}
	l.tagStep(&st)
	l.updateGauges()
	if l.statsLog.due(now, l.hits) {
		l.log.Info(l.hits.logLine(l.workerID))
	}
	b, err := st.Encode()
	if err != nil {
		return nil, fmt.Errorf("leader: encode step %d plan: %w", st.Seq, err)
	}
	return b, nil
}

// emitLoads moves planned loads into the step; their sources stay pinned
// until LoadsFinished.
func (l *Leader) emitLoads(st *plan.Step) {
	for _, s := range l.planned {
		if s.load != loadPlanned || l.slots[s.id] != s {
			continue // cancelled, emitted through an earlier entry, or finished
		}
		st.Loads = append(st.Loads, s.plannedLoad)
		il := l.inflight[s.id]
		if il == nil {
			il = &inflightLoad{reqID: s.id, at: l.now(), decided: s.decidedAt}
			l.inflight[s.id] = il
		}
		for _, src := range s.staged {
			if src.tier == plan.G4 {
				noteSalt(st, src.hash, s.salt)
			}
			l.loadsByG1[src.g1] = loadRef{reqID: s.id, k: len(il.sources), src: src}
			il.sources = append(il.sources, src)
			il.done = append(il.done, false)
		}
		s.staged = s.staged[:0]
		s.plannedLoad = plan.Load{}
		s.load = loadEmitted
	}
	clear(l.planned)
	l.planned = l.planned[:0]
}

// allocate takes one block of p for writing in this step; it is pinned until
// the step is emitted. A block rewritten in this step needs no Drop.
func (l *Leader) allocate(p *pool.Pool) (int, bool) {
	l.idxBuf = p.Allocate(1, l.idxBuf[:0])
	if len(l.idxBuf) == 0 {
		return 0, false
	}
	idx := l.idxBuf[0]
	delete(l.drops, tierBlock{p.Tier(), idx})
	return idx, true
}

// planMoves turns queued G2 blocks into G2→G3 copies.
func (l *Leader) planMoves(st *plan.Step) {
	if l.host == nil || l.disk == nil || l.bgMode || l.degraded {
		return
	}
	for n := 0; l.moves.Len() > 0 && (l.maxMoves == 0 || n < l.maxMoves); {
		e := heap.Pop(&l.moves).(moveEntry)
		if !l.host.Holds(e.idx, e.hash) {
			continue // evicted or invalidated since it was queued
		}
		if _, ok := l.disk.Lookup(e.hash); ok {
			continue
		}
		dst, ok := l.allocate(l.disk)
		if !ok {
			// Every disk block is pinned by running loads: retry next step.
			heap.Push(&l.moves, e)
			break
		}
		info := l.host.Info(e.idx)
		dst, _ = l.disk.RegisterShared(dst, e.hash, info.Parent, info.HasParent, info.Tokens, info.Priority)
		l.written = append(l.written, tierBlock{plan.G3, dst})
		l.host.Pin(e.idx)
		l.moveSrc = append(l.moveSrc, e.idx)
		st.Moves = append(st.Moves, plan.Copy{Src: plan.G2, SrcBlock: int64(e.idx), Dst: plan.G3, DstBlock: int64(dst)})
		l.m.OffloadH2D.Inc()
		n++
	}
}

// applyUpdate folds the engine's update into the slot and plans its saves.
func (l *Leader) applyUpdate(u *RequestUpdate, st *plan.Step, now time.Time) {
	s, created := l.slotFor(u.ReqID, u.Salt, now)
	if !s.seen && u.Salt != 0 {
		s.setSalt(u.Salt)
	}
	toks := u.NewTokens
	if u.KnownTokens > 0 && (!s.seen || u.Resumed) {
		if created || len(s.tokens) < u.KnownTokens {
			// The tokens from matching are gone (forgotten while idle):
			// the blocks' hashes cannot be computed.
			s.stopped = true
			l.log.Debug("kvbm: step update continues tokens the leader no longer has; not offloading it",
				"request", u.ReqID, "known", u.KnownTokens, "have", len(s.tokens))
			toks = nil
		} else {
			toks = append(slices.Clip(s.tokens[:u.KnownTokens]), u.NewTokens...)
		}
	} else if created && !u.Resumed && len(u.NewTokens) < u.NumComputedTokens+u.NumScheduledTokens {
		// A request's first update carries all its tokens; this one
		// continues a request the leader no longer knows (forgotten while
		// idle), so its blocks' hashes cannot be computed: never offload it.
		s.stopped = true
		l.log.Debug("kvbm: step update continues a request the leader does not know; not offloading it",
			"request", u.ReqID, "tokens", len(u.NewTokens), "computed", u.NumComputedTokens)
	}
	if !s.seen || u.Resumed {
		s.setTokens(toks, l.bs)
		if u.Resumed {
			s.resetBlocks()
		}
		// What the engine has computed when it (re)schedules a request came
		// from its own prefix cache or from a kvbm load: never offload it
		// again. Later steps only advance through blocks this slot saw being
		// computed, so a save that could not be placed is retried.
		s.offloaded = max(s.offloaded, u.NumComputedTokens/l.bs)
	} else {
		s.appendTokens(u.NewTokens)
	}
	s.seen = true
	s.mergeBlockIDs(u.NewBlockIDs, u.Priorities)
	if l.groups != nil {
		s.noteGroups(u.Groups, l.groups.Primary)
	}
	l.planSaves(s, u, st)
}

// planSaves is write-through offload for one request (design §4).
func (l *Leader) planSaves(s *slot, u *RequestUpdate, st *plan.Step) {
	if l.saveTo == nil || s.stopped || l.degraded {
		return
	}
	bs := l.bs
	end := min(u.NumComputedTokens+u.NumScheduledTokens, len(s.tokens)) / bs
	end = min(end, len(s.g1))
	start := s.offloaded
	if start >= end {
		return
	}
	s.ensureHashes(end, bs)
	for i := start; i < end; i++ {
		prio := s.prio[i]
		if prio == noPriority {
			prio = 0
		} else if l.minPrio > 0 && prio < l.minPrio {
			// Offloaded blocks stay a prefix of the request: nothing after
			// this block is offloaded either.
			s.stopped = true
			l.log.Debug("kvbm: offload terminated at block (priority below DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY)",
				"request", s.id, "block", i, "priority", prio, "min_priority", l.minPrio)
			return
		}
		var parent uint64
		if i > 0 {
			parent = s.hashes[i-1]
		}
		if !l.saveBlock(s, i, s.hashes[i], parent, i > 0, prio, st) {
			l.saveRetry = true
			return // the tier is full of pinned blocks; retried next step
		}
		if stateEnd := u.NumComputedTokens + u.NumScheduledTokens; (i+1)*bs == stateEnd && l.stateHeld(s, i) {
			// The step ends at this position's last token and the state
			// groups hold their state there: the position is stored a second
			// time, under its state key, from the same G1 blocks (design §11).
			// A tier full of pinned blocks only loses this state.
			l.saveBlock(s, i, hashing.StateHash(s.hashes[i]), s.hashes[i], true, prio, st)
		}
		s.offloaded = i + 1
	}
}

// stateHeld reports whether every recurrent-state group of s holds a block
// (not the null block) at position i. False without state groups.
func (l *Leader) stateHeld(s *slot, i int) bool {
	if !l.groups.hasState() || s.groups == nil {
		return false
	}
	for g, ids := range s.groups {
		if l.groups.isState(g) && (i >= len(ids) || ids[i] == l.groups.NullBlock) {
			return false
		}
	}
	return true
}

// saveBlock plans the save of s's G1 block at position i under h (unless
// the save tier has h already); false when the tier has no free block.
func (l *Leader) saveBlock(s *slot, i int, h, parent uint64, hasParent bool, prio int, st *plan.Step) bool {
	bs := l.bs
	tier := l.saveTo.Tier()
	if idx, ok := l.saveTo.Lookup(h); ok {
		l.saveTo.Touch(idx)
		if l.saveTo == l.host {
			l.noteHostRegistration(idx, h)
		}
		return true
	}
	dst, ok := l.allocate(l.saveTo)
	if !ok {
		return false
	}
	dst, _ = l.saveTo.Register(dst, h, parent, hasParent, s.tokens[i*bs:(i+1)*bs], prio)
	l.written = append(l.written, tierBlock{tier, dst})
	st.Saves = append(st.Saves, plan.Copy{Src: plan.G1, SrcBlock: s.g1[i], Dst: tier, DstBlock: int64(dst)})
	if tier == plan.G2 {
		l.m.OffloadD2H.Inc()
		l.noteHostRegistration(dst, h)
		l.planUpload(st, dst, h, parent, s.salt)
	} else {
		l.m.OffloadD2D.Inc()
	}
	return true
}

// noteHostRegistration is called when G2 block idx is (re-)registered under
// h or onboarded from: it feeds the frequency filter and queues the block for
// disk when it passes.
func (l *Leader) noteHostRegistration(idx int, h uint64) {
	count := l.noteAdmission(idx, h)
	if l.disk == nil || l.host == nil || l.degraded {
		return
	}
	if _, ok := l.disk.Lookup(h); ok {
		return
	}
	if _, ok := l.bgHashes[h]; ok {
		return // on its way to disk
	}
	if l.filter != nil && !l.filter.observe(h) {
		return
	}
	if l.moves.Len() >= 2*l.host.Capacity() {
		return // bounded: the disk is far behind; this block stays host-only
	}
	if !l.admitDisk(count) {
		return
	}
	l.moveSeq++
	heap.Push(&l.moves, moveEntry{prio: l.host.Info(idx).Priority, seq: l.moveSeq, idx: idx, hash: h})
}

// moveEntry is one queued G2→G3 copy. It holds no pin: if the G2 block is
// evicted before its turn, the entry is skipped.
type moveEntry struct {
	prio     int
	seq      uint64
	idx      int
	hash     uint64
	attempts int // background operations that failed with it
}

// moveQueue is a heap: highest priority first, then FIFO.
type moveQueue []moveEntry

func (q moveQueue) Len() int { return len(q) }
func (q moveQueue) Less(i, j int) bool {
	if q[i].prio != q[j].prio {
		return q[i].prio > q[j].prio
	}
	return q[i].seq < q[j].seq
}
func (q moveQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *moveQueue) Push(x any)   { *q = append(*q, x.(moveEntry)) }
func (q *moveQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}
func (q *moveQueue) clear() { *q = (*q)[:0] }
