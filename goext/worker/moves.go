package worker

// Background moves: an engine step's G2→G3 Moves run after WaitForSave
// returns, so that the engine's step never waits for the disk.
//
// WaitForSave queues the step's Moves and returns once its Saves (which read
// G1, which the engine may overwrite once the step ends) are done. One
// goroutine runs the queued moves in step order. Until a move has run, its G2
// source and its G3 destination are held by the worker: any later work that
// would change what the move reads or writes — a Drop of either block, a copy
// into the G2 source, a copy into or out of the G3 destination, in a bound
// step or a side-channel Run — first waits for the queue to drain. So every
// step still sees the tiers as if the earlier steps' moves had finished
// before it started (the leader's timing model: a block moved in step N is
// readable from step N+1 on), and the engine waits for the disk only when a
// step touches a block still being moved.

import (
	"github.com/kvbm/kvbm/goext/plan"
)

// moveQueue is the state of the background moves; guarded by Worker.mu.
type moveQueue struct {
	steps   [][]plan.Copy // queued moves, one entry per step, oldest first (steps[0] may be running)
	host    map[int64]int // G2 sources of queued moves → how many
	disk    map[int64]int // G3 destinations of queued moves → how many
	running bool          // the goroutine runs (steps non-empty, or finishing the last one)
}

// queueMovesLocked queues moves to run in the background, after every move
// queued before them; mu is held. The goroutine counts in saves, so Close
// waits for it before unmapping the regions.
func (w *Worker) queueMovesLocked(moves []plan.Copy) {
	if len(moves) == 0 {
		return
	}
	q := &w.moves
	if q.host == nil {
		q.host, q.disk = map[int64]int{}, map[int64]int{}
	}
	for _, c := range moves {
		q.host[c.SrcBlock]++
		q.disk[c.DstBlock]++
	}
	q.steps = append(q.steps, moves)
	if !q.running {
		q.running = true
		w.saves.Add(1) // callers hold a count of saves themselves, so this never races Close's Wait
		go w.runMoveQueue()
	}
}

// runMoveQueue runs the queued moves, one step at a time, until the queue is empty.
func (w *Worker) runMoveQueue() {
	defer w.saves.Done()
	for {
		w.mu.Lock()
		q := &w.moves
		if len(q.steps) == 0 {
			q.running = false
			w.movesDone.Broadcast()
			w.mu.Unlock()
			return
		}
		moves := q.steps[0]
		w.mu.Unlock()

		if errs := w.runOps(moves, nil); countErrs(errs) > 0 {
			w.logFailures("move", moves, errs)
		}

		w.mu.Lock()
		q.steps[0] = nil
		q.steps = q.steps[1:]
		for _, c := range moves {
			release(q.host, c.SrcBlock)
			release(q.disk, c.DstBlock)
		}
		w.movesDone.Broadcast()
		w.mu.Unlock()
	}
}

func release(m map[int64]int, b int64) {
	if m[b]--; m[b] <= 0 {
		delete(m, b)
	}
}

// waitMovesLocked waits, with mu held, until every queued move has run.
func (w *Worker) waitMovesLocked() {
	for w.moves.running {
		w.movesDone.Wait()
	}
}

// WaitMoves blocks until every G2→G3 move queued so far has run (their
// G3 blocks are then written, or invalid if the write failed).
func (w *Worker) WaitMoves() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waitMovesLocked()
}

// settleMoves waits for the queued moves when s (its drops, loads, moves
// and saves) touches a block that one of them still reads or writes. mu
// must not be held.
func (w *Worker) settleMoves(s *plan.Step) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.moves.running && (w.dropsConflictLocked(s.Drops) || w.copiesConflictLocked(s.Moves) ||
		w.copiesConflictLocked(s.Saves) || w.loadsConflictLocked(s.Loads)) {
		w.waitMovesLocked()
	}
}

// heldLocked reports whether block b of tier t is held by a queued move.
func (w *Worker) heldLocked(t plan.Tier, b int64) bool {
	switch t {
	case plan.G2:
		return w.moves.host[b] > 0
	case plan.G3:
		return w.moves.disk[b] > 0
	}
	return false
}

// copiesConflictLocked reports whether one of cs touches a held block: a
// copy may read a held G2 source (reads do not race) but not write it; a
// held G3 destination may be neither read nor written. mu is held.
func (w *Worker) copiesConflictLocked(cs []plan.Copy) bool {
	for _, c := range cs {
		if (c.Src == plan.G3 && w.heldLocked(plan.G3, c.SrcBlock)) || (c.Dst != plan.G1 && w.heldLocked(c.Dst, c.DstBlock)) {
			return true
		}
	}
	return false
}

func (w *Worker) loadsConflictLocked(loads []plan.Load) bool {
	for _, ld := range loads {
		if w.copiesConflictLocked(ld.Copies) {
			return true
		}
	}
	return false
}

// dropsConflictLocked: a dropped block (named as the drop's source) must
// not be held.
func (w *Worker) dropsConflictLocked(drops []plan.Copy) bool {
	for _, d := range drops {
		if w.heldLocked(d.Src, d.SrcBlock) {
			return true
		}
	}
	return false
}
