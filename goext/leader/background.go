package leader

import (
	"container/heap"
	"fmt"
	"slices"

	"github.com/kvbm/kvbm/goext/plan"
)

// Background operations (design §2, tensor parallelism): with
// Options.SideChannel (or Options.Background), G2→G3 moves no longer ride in
// the engine's step plans. They travel over the leader⇄worker side channel
// instead, and a G3 block is registered (announced to the consolidator
// through the Sink, matchable) only once every rank acknowledged writing its
// shard. With Options.SideChannel the leader's own loop (sidechannel.go)
// runs, after each Step:
//
//	step, ticket, _ := l.PlanBackground() // nil step: nothing to do
//	err := sideChannel.Broadcast(ctx, step) // every rank runs it (worker.Run)
//	l.CommitBackground(ticket, err == nil)
//
// While a ticket is open its G2 sources stay pinned (no save can overwrite
// them) and its G3 destinations are allocated but unregistered (no load can
// read them, no other operation can take them). A failed ticket frees the
// destinations and requeues its moves (a few attempts). Tickets may be
// committed in any order and from any goroutine; every ticket must be
// committed exactly once.
//
// A background step's Seq is the last engine step planned so far: workers
// run it only after that step's saves (worker.Run waits for them), so a move
// never copies a G2 block before the save that fills it.
//
// A ticket committed failed (a timeout) may still run later on some ranks.
// That is harmless because every rank runs side-channel operations in the
// order they were sent: its G3 destinations are unregistered until a later
// operation takes them, and that later operation runs after it, so the bytes
// registered are always the later operation's. Engine steps never write G3
// in background mode (saves go to G2).

// defaultBackgroundMoves caps one background operation when
// Options.MaxMovesPerStep is 0: the worker serialises it with the engine's
// wait_for_save, so a huge one would stall an engine step.
const defaultBackgroundMoves = 256

// maxMoveAttempts bounds how often a move whose operation failed is queued
// again (a rank whose disk broke would otherwise fail every operation).
const maxMoveAttempts = 3

type bgMove struct {
	entry     moveEntry // to requeue on failure
	dst       int       // G3 block, allocated and pinned until commit
	parent    uint64
	hasParent bool
	tokens    []uint32 // shared with the G2 block (immutable)
}

type bgOp struct {
	gen   uint64 // ResetCache generation when planned
	moves []bgMove
}

// PlanBackground takes queued G2→G3 moves out of the queue and returns them
// as an encoded plan.Step (Moves only) for every worker, with the ticket to
// commit it under. It returns (nil, 0, nil) when there is nothing to do: not
// in background mode, degraded, no host or disk tier, or an empty queue.
func (l *Leader) PlanBackground() (step []byte, ticket uint64, err error) {
	l.mu.Lock()
	defer l.unlock()
	if !l.bgMode || l.degraded || l.host == nil || l.disk == nil {
		return nil, 0, nil
	}
	limit := l.maxMoves
	if limit <= 0 {
		limit = defaultBackgroundMoves
	}
	op := &bgOp{gen: l.gen}
	st := plan.Step{Seq: l.seq}
	for l.moves.Len() > 0 && len(op.moves) < limit {
		e := heap.Pop(&l.moves).(moveEntry)
		if !l.host.Holds(e.idx, e.hash) {
			continue // evicted or invalidated since it was queued
		}
		if _, ok := l.disk.Lookup(e.hash); ok {
			continue
		}
		if _, ok := l.bgHashes[e.hash]; ok {
			continue // already on its way to disk
		}
		dst, ok := l.allocate(l.disk)
		if !ok {
			heap.Push(&l.moves, e) // every disk block is pinned: retry later
			break
		}
		info := l.host.Info(e.idx)
		l.host.Pin(e.idx)
		l.bgHashes[e.hash] = struct{}{}
		op.moves = append(op.moves, bgMove{entry: e, dst: dst, parent: info.Parent, hasParent: info.HasParent, tokens: info.Tokens})
		st.Moves = append(st.Moves, plan.Copy{Src: plan.G2, SrcBlock: int64(e.idx), Dst: plan.G3, DstBlock: int64(dst)})
	}
	if len(op.moves) == 0 {
		return nil, 0, nil
	}
	l.bgNext++
	ticket = l.bgNext
	l.bgOps[ticket] = op
	l.tagBackground(&st, op)
	b, err := st.Encode()
	if err != nil {
		l.commitLocked(ticket, false)
		return nil, 0, fmt.Errorf("leader: encode background operation %d (%d moves): %w", ticket, len(st.Moves), err)
	}
	return b, ticket, nil
}

// CommitBackground closes ticket. ok: every rank executed the operation, so
// its G3 blocks are registered (store events go to the Sink) and count as
// offloaded; a ResetCache since PlanBackground discards them instead.
// !ok: the destinations go back to the free list unregistered (never
// announced) and the moves are queued again, unless degraded. An unknown or
// already committed ticket is an error.
func (l *Leader) CommitBackground(ticket uint64, ok bool) error {
	l.mu.Lock()
	defer l.unlock()
	if _, found := l.bgOps[ticket]; !found {
		return fmt.Errorf("leader: commit of unknown background ticket %d (never planned or already committed)", ticket)
	}
	l.commitLocked(ticket, ok)
	l.updateGauges()
	return nil
}

func (l *Leader) commitLocked(ticket uint64, ok bool) {
	op := l.bgOps[ticket]
	delete(l.bgOps, ticket)
	register := ok && op.gen == l.gen
	for _, mv := range op.moves {
		e := mv.entry
		delete(l.bgHashes, e.hash)
		switch {
		case register:
			idx, _ := l.disk.RegisterShared(mv.dst, e.hash, mv.parent, mv.hasParent, mv.tokens, e.prio)
			l.disk.Release(idx) // inactive: findable, evictable
			l.m.OffloadH2D.Inc()
		default:
			// Unregistered: back to the free list. Ranks that did write it
			// hold valid bytes for a block nobody can find; the next
			// allocation rewrites it before registering.
			l.disk.Release(mv.dst)
			e.attempts++
			if !ok && !l.degraded && op.gen == l.gen && e.attempts < maxMoveAttempts && l.host.Holds(e.idx, e.hash) {
				heap.Push(&l.moves, e)
			}
		}
		l.host.Unpin(e.idx)
	}
}

// BackgroundInFlight is the number of planned, not yet committed tickets.
func (l *Leader) BackgroundInFlight() int {
	l.mu.Lock()
	defer l.unlock()
	return len(l.bgOps)
}

// SetDegraded records that tensor-parallel ranks died or stopped answering
// (their shard of every block may be missing, and a dead rank is never
// trusted again). From then on the leader matches nothing
// (GetNumNewMatchedTokens returns (0, false)), plans no saves and no moves,
// and PlanBackground returns nothing: the engine keeps serving and
// recomputes. Loads already promised to the engine still go out with the
// next Step, so it is not left waiting for them. It logs once per new set of
// ranks; an empty list changes nothing.
func (l *Leader) SetDegraded(deadRanks []int) {
	if len(deadRanks) == 0 {
		return
	}
	ranks := slices.Clone(deadRanks)
	slices.Sort(ranks)
	ranks = slices.Compact(ranks)
	l.mu.Lock()
	defer l.unlock()
	if l.degraded && slices.Equal(ranks, l.deadRanks) {
		return
	}
	l.degraded = true
	l.deadRanks = ranks
	l.moves.clear()
	l.log.Error("kvbm: tensor-parallel worker rank(s) died or stopped answering; kvbm stops matching and offloading "+
		"for this engine (it keeps serving and recomputes)", "dead_ranks", fmt.Sprint(ranks))
}

// Degraded reports whether SetDegraded was called, and with which ranks.
func (l *Leader) Degraded() (bool, []int) {
	l.mu.Lock()
	defer l.unlock()
	return l.degraded, slices.Clone(l.deadRanks)
}

// BlocksUsed is the number of registered (findable) G2 and G3 blocks.
func (l *Leader) BlocksUsed() (host, disk int) {
	l.mu.Lock()
	defer l.unlock()
	if l.host != nil {
		host = l.host.NumRegistered()
	}
	if l.disk != nil {
		disk = l.disk.NumRegistered()
	}
	return host, disk
}
