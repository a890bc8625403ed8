package leader

import (
	"slices"
	"time"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

// slotFor returns the request's slot, creating it with salt when absent
// (salt 0 means "not given": the default salt hash of a request without cache
// salt and LoRA), touched at now; created reports that it was absent.
func (l *Leader) slotFor(reqID string, salt uint64, now time.Time) (s *slot, created bool) {
	s, ok := l.slots[reqID]
	if !ok {
		if salt == 0 {
			salt = hashing.DefaultSaltHash
		}
		if n := len(l.spare); n > 0 {
			s = l.spare[n-1]
			l.spare = l.spare[:n-1]
		} else {
			s = &slot{}
		}
		s.id, s.salt = reqID, salt
		l.slots[reqID] = s
	}
	l.touch(s, now)
	return s, !ok
}

// GetNumNewMatchedTokens applies design §4's external matching rule to a
// request whose first numComputed tokens are already in G1 (the engine's own
// prefix-cache hit). tokens are all the request's tokens; salt is its salt
// hash (hashing.SaltHash; 0 = default).
//
//  1. numComputed must be block aligned (else (0, false)), and at least one
//     full block must remain beyond it (else (0, false)).
//  2. Sequence hashes of all full blocks; matching starts after the G1 hit.
//  3. Contiguous prefix in G2, then continue in G3 where G2 stopped (a G3 hit
//     never fills a gap before a G2 hit).
//  4. If that covers the whole prompt, the last matched block is dropped from
//     the deepest tier used: the engine must compute at least one token, and
//     computed counts stay block aligned.
//  5. The matched blocks are pinned (staged) and (tokens, true) returned: the
//     load is asynchronous. Nothing matched: (0, false).
//
// Calling it again for the same request re-stages from scratch (the previous
// pins are released first, so nothing is pinned twice). It returns (0, false)
// while a load for the request is already with the workers.
func (l *Leader) GetNumNewMatchedTokens(reqID string, tokens []uint32, salt uint64, numComputed int) (int, bool) {
	l.mu.Lock()
	defer l.unlock()
	bs := l.bs
	// Whatever the answer, the slot keeps the tokens: the request's step
	// updates then carry only the tokens after them (RequestUpdate.KnownTokens).
	s, _ := l.slotFor(reqID, salt, l.now())
	if s.load == loadEmitted {
		s.setTokens(tokens, bs)
		l.log.Warn("kvbm: get_num_new_matched_tokens while the request's load is running; not matching again",
			"request", reqID)
		return 0, false
	}
	l.unstage(s)
	if salt != 0 {
		s.setSalt(salt)
	}
	s.setTokens(tokens, bs)
	if l.degraded {
		// A rank's shards may be missing: serve nothing (SetDegraded).
		return 0, false
	}
	if numComputed < 0 || numComputed%bs != 0 {
		// A partial G1 hit (TensorRT-LLM partial reuse): kvbm only loads
		// whole blocks after a block-aligned prefix. Any earlier staging
		// for the request is forgotten.
		return 0, false
	}
	s.matched = true
	s.hits = requestHits{}
	if len(tokens)-numComputed < bs {
		return 0, false
	}

	nFull := len(tokens) / bs
	s.ensureHashes(nFull, bs)
	query := s.hashes[numComputed/bs : nFull]
	s.hits.queried = len(query)

	srcs := slices.Grow(s.staged[:0], len(query))
	nHost := 0
	if l.host != nil {
		l.idxBuf = l.host.Match(query, l.idxBuf[:0])
		nHost = len(l.idxBuf)
		for k, idx := range l.idxBuf {
			srcs = append(srcs, source{tier: plan.G2, idx: idx, hash: query[k]})
		}
	}
	if l.disk != nil {
		rest := query[nHost:]
		l.idxBuf = l.disk.Match(rest, l.idxBuf[:0])
		for k, idx := range l.idxBuf {
			srcs = append(srcs, source{tier: plan.G3, idx: idx, hash: rest[k]})
		}
	}
	if l.g4 != nil && l.g4WorthLooking(reqID, len(query)-len(srcs)) {
		rest := query[len(srcs):]
		var alt []uint64
		if l.groups.hasState() {
			alt = make([]uint64, len(rest))
			for k, h := range rest {
				alt[k] = hashing.StateHash(h)
			}
		}
		n, pending := l.g4Match(reqID, s.salt, rest, alt)
		if pending {
			return Pending, false // nothing pinned; the engine asks again
		}
		for _, h := range rest[:n] {
			srcs = append(srcs, source{tier: plan.G4, idx: -1, hash: h}) // bounce allocated when planned
		}
	}
	state := l.groups.hasState()
	if state {
		// A hybrid model's recurrent state: the hit ends where a stored
		// state does, and leaves the engine at least one token (vLLM's own
		// hits on such models end on a block boundary before the last token).
		srcs = l.stateCut(s, srcs[:min(len(srcs), (len(tokens)-1-numComputed)/bs)], numComputed/bs)
	}
	if numComputed+len(srcs)*bs == len(tokens) && !l.fullHit {
		// Full-prompt hit, and the engine takes only whole blocks: the last
		// block is left to it. The sources are ordered host then disk, so the
		// last one is from the deepest tier used.
		srcs = srcs[:len(srcs)-1]
	}
	matched := len(srcs)
	srcs = l.applyLoadPolicy(reqID, srcs) // DYN_KVBM_LOAD_POLICY (policy.go)
	if state && len(srcs) < matched {
		srcs = l.stateCut(s, srcs, numComputed/bs) // the policy kept a shorter prefix
	}
	for {
		k := l.pinSources(srcs)
		if k == len(srcs) {
			break
		}
		// No G2 bounce block for the G4 source at k: the match stops there.
		// A state model's hit must end on a stored state again, so the pins
		// are released and the shorter match pinned anew.
		for j := range srcs {
			l.releaseSource(srcs[j])
			if srcs[j].tier == plan.G4 {
				srcs[j].idx = -1
			}
		}
		srcs = srcs[:k]
		if state {
			srcs = l.stateCut(s, srcs, numComputed/bs)
		}
	}
	for _, src := range srcs {
		switch src.tier {
		case plan.G2:
			s.hits.host++
		case plan.G3:
			s.hits.disk++
		}
	}
	s.staged = srcs
	if len(srcs) == 0 {
		return 0, false
	}
	s.load = loadStaged
	s.computedAt = numComputed
	s.decidedAt = l.now()
	n := len(srcs) * bs
	if numComputed+n == len(tokens) {
		// LoadFullHit: every block loads; the engine computes the last token.
		n--
	}
	return n, true
}

// stateCut shortens srcs (s's matched blocks from position base on) to the
// longest prefix whose last position has its state stored (under
// hashing.StateHash, in G2, G3 or G4's registry), and makes that position
// load from the state block. Empty when no matched position has one: a hit
// on a model with recurrent state needs the state at its end (design §11).
func (l *Leader) stateCut(s *slot, srcs []source, base int) []source {
	for k := len(srcs); k > 0; k-- {
		h := hashing.StateHash(s.hashes[base+k-1])
		switch {
		case l.host != nil && l.has(l.host, h):
			idx, _ := l.host.Lookup(h)
			srcs[k-1] = source{tier: plan.G2, idx: idx, hash: h}
		case l.disk != nil && l.has(l.disk, h):
			idx, _ := l.disk.Lookup(h)
			srcs[k-1] = source{tier: plan.G3, idx: idx, hash: h}
		case l.g4 != nil && !l.g4.off() && l.g4.reg.Contains(h):
			srcs[k-1] = source{tier: plan.G4, idx: -1, hash: h}
		default:
			continue
		}
		return srcs[:k]
	}
	return srcs[:0]
}

// pinSources pins srcs' G2 and G3 blocks, then takes a G2 bounce block for
// each G4 source in order (after the pins, so that a bounce block cannot
// evict a source), and returns how many leading sources it could take
// (len(srcs) when all). Every pin and bounce block taken stays taken.
func (l *Leader) pinSources(srcs []source) int {
	for _, src := range srcs {
		if src.tier != plan.G4 {
			l.poolOf(src.tier).Pin(src.idx)
		}
	}
	for k := range srcs {
		if srcs[k].tier == plan.G4 && !l.g4Bounce(&srcs[k]) {
			return k
		}
	}
	return len(srcs)
}

func (l *Leader) has(p *pool.Pool, h uint64) bool {
	_, ok := p.Lookup(h)
	return ok
}

// unstage releases a staged or planned (not yet emitted) load.
func (l *Leader) unstage(s *slot) {
	if s.load != loadStaged && s.load != loadPlanned {
		return
	}
	for _, src := range s.staged {
		l.releaseSource(src)
	}
	s.staged = s.staged[:0]
	s.plannedLoad = plan.Load{}
	s.load = loadNone // a planned slot left in l.planned is skipped by Step
}

// UpdateStateAfterAlloc plans the load of the request's staged blocks into
// its G1 blocks: the blocks right after the numComputed tokens it had at
// GetNumNewMatchedTokens time. g1BlockIDs are the request's G1 blocks (vLLM:
// blocks.get_block_ids()[0]; TensorRT-LLM: all prompt blocks).
//
// numExternalTokens is what the engine accepted; it may be less than the match
// (the unused tail is unpinned). 0 with a staged match means the engine will
// not load: the staged blocks are released. vLLM calls this a second time with
// 0 after the async load: a planned or running load is kept (design §6.1).
// The copies go out with the next Step; onboard metrics and matched tokens
// are counted here, when the load is planned.
func (l *Leader) UpdateStateAfterAlloc(reqID string, g1BlockIDs []int64, numExternalTokens int) {
	l.mu.Lock()
	defer l.unlock()
	s, ok := l.slots[reqID]
	if ok {
		l.touch(s, l.now())
	}
	if !ok || s.load != loadStaged {
		if ok && numExternalTokens > 0 && s.load == loadNone {
			l.log.Warn("kvbm: update_state_after_alloc promises external tokens that were not matched",
				"request", reqID, "external_tokens", numExternalTokens)
		}
		return
	}
	if numExternalTokens <= 0 {
		l.unstage(s)
		return
	}
	bs := l.bs
	// A full hit is accepted one token short of its last block
	// (LoadFullHit): that block still loads whole.
	n := min((numExternalTokens+bs-1)/bs, len(s.staged))
	first := s.computedAt / bs
	if avail := len(g1BlockIDs) - first; n > avail {
		l.log.Warn("kvbm: fewer G1 blocks than promised external tokens; loading what fits",
			"request", reqID, "g1_blocks", len(g1BlockIDs), "first_load_block", first,
			"external_tokens", numExternalTokens)
		n = max(avail, 0)
	}
	for _, src := range s.staged[n:] {
		l.releaseSource(src)
	}
	s.staged = s.staged[:n]
	if n == 0 {
		s.load = loadNone
		return
	}
	copies := make([]plan.Copy, n, n+n/4)
	var fromHost, fromDisk, fromG4 int
	for k := range s.staged {
		src := &s.staged[k]
		src.g1 = g1BlockIDs[first+k]
		copies[k] = plan.Copy{Src: src.tier, SrcBlock: int64(src.idx), Dst: plan.G1, DstBlock: src.g1}
		if src.tier == plan.G4 {
			fromG4++
			copies[k].Src = plan.G2 // from the bounce block, after its download
			copies = append(copies, plan.Copy{Src: plan.G4, SrcBlock: int64(src.hash), Dst: plan.G2, DstBlock: int64(src.idx)})
			continue
		}
		if src.tier == plan.G2 {
			fromHost++
			// A G2 hit that is used counts like a re-registration for the
			// disk frequency filter ("frequency doubles on cache hit").
			l.noteHostRegistration(src.idx, src.hash)
		} else {
			fromDisk++
		}
	}
	s.plannedLoad = plan.Load{ReqID: reqID, Copies: copies}
	s.load = loadPlanned
	l.planned = append(l.planned, s)
	l.m.OnboardH2D.Add(float64(fromHost))
	l.m.OnboardD2D.Add(float64(fromDisk))
	if fromG4 > 0 {
		object.CountOnboard(fromG4)
	}
	l.m.MatchedTokens.Add(float64(min(n*bs, numExternalTokens)))
}

// LoadSources splits the first numTokens tokens of reqID's planned load
// (UpdateStateAfterAlloc, before the next Step) by the tier each block comes
// from, block by block in prefix order: host (G2), disk (G3), remote (G4).
// Tokens past the planned blocks, or of a request with no planned load, are
// in none of them.
func (l *Leader) LoadSources(reqID string, numTokens int) (host, disk, remote int) {
	l.mu.Lock()
	defer l.unlock()
	s, ok := l.slots[reqID]
	if !ok || s.load != loadPlanned {
		return 0, 0, 0
	}
	l.touch(s, l.now())
	for _, src := range s.staged {
		n := min(l.bs, numTokens)
		if n <= 0 {
			break
		}
		numTokens -= n
		switch src.tier {
		case plan.G2:
			host += n
		case plan.G3:
			disk += n
		default:
			remote += n
		}
	}
	return host, disk, remote
}

// LoadsFinished releases the sources of the requests' loads once the workers
// reported them finished (successfully or not; failures come through
// LoadErrors, in either order: the leader remembers the last load into each
// G1 block). Unknown ids are ignored.
func (l *Leader) LoadsFinished(reqIDs []string) {
	l.mu.Lock()
	defer l.unlock()
	for _, id := range reqIDs {
		il, ok := l.inflight[id]
		if !ok {
			continue
		}
		for k, src := range il.sources {
			if !il.done[k] {
				l.releaseSource(src)
			}
		}
		l.timeLoad(il)
		delete(l.inflight, id)
		if s, ok := l.slots[id]; ok && s.load == loadEmitted {
			s.load = loadNone
			l.touch(s, l.now())
		}
	}
}

// LoadErrors handles G1 blocks whose load failed (copy error, or a G3
// checksum that did not verify): the source registration is dropped from its
// tier (it must never be served again), its pin released, and the failure
// counted. The engine recomputes those blocks; their offload later registers
// fresh copies. Ids that were not loaded by kvbm are ignored.
func (l *Leader) LoadErrors(g1BlockIDs []int64) {
	l.mu.Lock()
	defer l.unlock()
	for _, g1 := range g1BlockIDs {
		ref, ok := l.loadsByG1[g1]
		if !ok {
			continue
		}
		delete(l.loadsByG1, g1)
		l.m.LoadErrors.Inc()
		p := l.poolOf(ref.src.tier)
		if il, ok := l.inflight[ref.reqID]; ok && ref.k < len(il.sources) && il.sources[ref.k] == ref.src && !il.done[ref.k] {
			il.done[ref.k] = true
			p.Unpin(ref.src.idx)
		}
		if ref.src.tier == plan.G4 {
			l.g4LoadFailed(ref.src.hash)
		} else if p.Holds(ref.src.idx, ref.src.hash) {
			idx, _ := p.Invalidate(ref.src.hash)
			l.dropIfFree(p, idx)
			l.log.Warn("kvbm: load failed; dropped the source block", "tier", ref.src.tier,
				"block", idx, "seq_hash", ref.src.hash, "g1_block", g1, "request", ref.reqID)
		}
	}
	l.updateGauges()
}

// RequestFinished forgets the request. Its hit counts join the hit-rate
// window, and a staged or planned load is cancelled (pins released).
//
// It always returns false (design §6.1: true only while a save is in flight):
// Step plans and emits a request's saves in the same call, and workers
// execute a step's saves inside that step, before the engine can reuse the G1
// blocks it frees now, so no save is ever outstanding. A load already with the
// workers keeps its sources pinned until LoadsFinished.
func (l *Leader) RequestFinished(reqID string) bool {
	l.mu.Lock()
	defer l.unlock()
	s, ok := l.slots[reqID]
	if !ok {
		return false
	}
	if s.matched {
		l.hits.add(s.hits)
	}
	l.forget(s)
	return false
}

// forget drops s: its staged or planned load is cancelled (pins released),
// its G4 lookup state dropped, and the slot kept for reuse. A load already
// with the workers keeps its sources pinned until LoadsFinished. l.mu held.
func (l *Leader) forget(s *slot) {
	l.unstage(s)
	l.g4Forget(s.id)
	l.unlinkIdle(s)
	delete(l.slots, s.id)
	if len(l.spare) < maxSpareSlots && cap(s.tokens) <= maxSpareTokens {
		s.recycle()
		l.spare = append(l.spare, s)
	}
}

// Finished slots are kept for reuse, up to these bounds (memory held: at most
// maxSpareSlots × maxSpareTokens × ~7 bytes).
const (
	maxSpareSlots  = 64
	maxSpareTokens = 256 * 1024
)
