package worker

// The engine's per-step calls (Bind, StartLoad, WaitLoads, WaitForSave,
// Finished) and Run, the same execution for side-channel operations.

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvbm/kvbm/goext/plan"
)

// BindStep decodes the leader's step and applies its Drops. If the engine
// skipped StartLoad or WaitForSave for the previous step, they run now: a
// step's work is never silently lost.
func (w *Worker) BindStep(b []byte) error {
	_, err := w.BindPlan(b)
	return err
}

// Bound is what the engine adapter must know of a bound step, so that it
// never decodes the plan itself: the loads it must later report to the
// engine (finished, or failed after a kvbm failure), and which of the
// step's calls have work.
type Bound struct {
	// Loads: one per request with a load in the step, its G1 blocks (the
	// blocks its copies write; staging copies into G2 are not G1 blocks).
	Loads []BoundLoad
	// Start: the step has loads, StartLoad launches them. Save: it has
	// moves, saves or uploads, WaitForSave runs them. A call without work
	// may be left out: the step is already saved when bound without any,
	// and a step's StartLoad without loads does nothing.
	Start, Save bool
}

// BoundLoad is one request's load in a bound step.
type BoundLoad struct {
	_msgpack struct{} `msgpack:",as_array"`
	ReqID    string
	G1       []int64
}

// Empty reports whether the adapter has nothing to act on.
func (b Bound) Empty() bool { return len(b.Loads) == 0 && !b.Start && !b.Save }

// BindPlan is BindStep returning what the adapter must act on (Bound).
func (w *Worker) BindPlan(b []byte) (Bound, error) {
	s, err := plan.Decode(b)
	if err != nil {
		return Bound{}, fmt.Errorf("worker: rank %d: %w", w.opts.Rank, err)
	}
	if err := w.Bind(s); err != nil {
		return Bound{}, err
	}
	return boundOf(s), nil
}

func boundOf(s *plan.Step) Bound {
	out := Bound{Start: len(s.Loads) > 0, Save: len(s.Moves) > 0 || len(s.Saves) > 0 || len(s.Uploads) > 0}
	for _, ld := range s.Loads {
		g1 := make([]int64, 0, len(ld.Copies))
		for _, c := range ld.Copies {
			if c.Dst == plan.G1 {
				g1 = append(g1, c.DstBlock)
			}
		}
		out.Loads = append(out.Loads, BoundLoad{ReqID: ld.ReqID, G1: g1})
	}
	return out
}

// Bind is BindStep for an already decoded step.
func (w *Worker) Bind(s *plan.Step) error {
	w.mu.Lock()
	if w.g1 == nil {
		w.mu.Unlock()
		return errors.New("worker: bind step: KV caches not registered yet")
	}
	prev := w.step
	startPrev := prev != nil && !w.loadsRun
	savePrev := prev != nil && !w.savesRun
	w.mu.Unlock()
	if startPrev {
		w.log.Debug("kvbm worker: previous step's loads were not started; starting them now", "seq", prev.Seq)
		w.StartLoad()
	}
	if savePrev {
		w.log.Debug("kvbm worker: previous step's saves did not run; running them now", "seq", prev.Seq)
		w.WaitForSave()
	}

	w.lockExec()
	defer w.unlockExec()
	// Before the step changes anything: wait for the queued moves if it
	// touches a block they still read or write.
	w.settleMoves(s)
	w.mu.Lock()
	if s.Seq != 0 && s.Seq <= w.lastSeq {
		w.log.Warn("kvbm worker: step sequence went backwards; executing anyway", "seq", s.Seq, "last", w.lastSeq)
	}
	w.lastSeq = max(w.lastSeq, s.Seq)
	w.step, w.loadsRun, w.savesRun = s, false, false
	if len(s.Moves) == 0 && len(s.Saves) == 0 && len(s.Uploads) == 0 {
		// Nothing to save: the step is saved as soon as it is bound. An
		// engine step without a forward pass may never call WaitForSave, and
		// a side-channel operation planned after it (Run with this Seq) must
		// not wait for the next step, which an idle engine never sends.
		w.savesRun = true
		if s.Seq > w.savedSeq {
			w.savedSeq = s.Seq
			w.savedChangedLocked()
		}
	}
	w.mu.Unlock()
	// Drops first: the leader may drop a block and hand it out again in the
	// same step, so the step's own writes must land after the drop.
	w.applyDrops(s.Drops)
	w.stageTags(s)
	return nil
}

func (w *Worker) applyDrops(drops []plan.Copy) {
	for _, d := range drops {
		// A drop names its block as the copy's source.
		switch {
		case d.Src == plan.G2 && d.SrcBlock >= 0 && d.SrcBlock < int64(len(w.hostValid)):
			w.hostValid[d.SrcBlock].Store(false)
			w.forgetHostTag(d.SrcBlock)
		case d.Src == plan.G3 && d.SrcBlock >= 0 && d.SrcBlock < int64(len(w.diskValid)):
			w.diskValid[d.SrcBlock].Store(false)
			w.diskSum[d.SrcBlock].Store(0)
			w.forgetOnDisk(int(d.SrcBlock))
		default:
			w.log.Warn("kvbm worker: ignoring drop of an unknown block", "tier", d.Src, "block", d.SrcBlock)
		}
	}
}

// StartLoad launches the bound step's Loads in the background; Finished
// reports them once done. Copies into G2 (G3→G2 staging) run before the
// copies into G1 of the same step, so a load may stage through G2.
func (w *Worker) StartLoad() {
	w.lockExec()
	defer w.unlockExec()
	w.mu.Lock()
	s := w.step
	if s == nil || w.loadsRun || w.closed {
		w.mu.Unlock()
		return
	}
	w.loadsRun = true
	if len(s.Loads) == 0 {
		w.mu.Unlock()
		return
	}
	w.loading++
	w.mu.Unlock()
	w.fence("load")
	go func() {
		defer w.loadFinished()
		w.runLoads(s.Loads, s.G1Groups.Map(), s.SaltOf())
	}()
}

// loadFinished is the last thing a load goroutine does.
func (w *Worker) loadFinished() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.loading--; w.loading == 0 {
		w.loadingDone.Broadcast()
	}
}

// waitLoadsLocked waits, with mu held, until no load goroutine runs.
func (w *Worker) waitLoadsLocked() {
	for w.loading > 0 {
		w.loadingDone.Wait()
	}
}

func (w *Worker) runLoads(loads []plan.Load, rows map[int64][]int64, saltOf func(uint64) uint64) {
	failed := w.execLoads(loads, rows, saltOf)
	bad := make(map[int64]bool, len(failed))
	for _, b := range failed {
		bad[b] = true
	}
	w.mu.Lock()
	for _, ld := range loads {
		w.loaded = append(w.loaded, ld.ReqID)
		if len(bad) > 0 && slices.ContainsFunc(ld.Copies, func(c plan.Copy) bool { return c.Dst == plan.G1 && bad[c.DstBlock] }) {
			w.loadFailedReqs = append(w.loadFailedReqs, ld.ReqID)
		}
	}
	w.loadErrs = append(w.loadErrs, failed...)
	w.mu.Unlock()
}

// execLoads copies loads' blocks, staging copies (into G2) before copies into
// G1, and returns the G1 blocks whose copy failed.
func (w *Worker) execLoads(loads []plan.Load, rows map[int64][]int64, saltOf func(uint64) uint64) (failed []int64) {
	var staging, direct []plan.Copy
	for _, ld := range loads {
		for _, c := range ld.Copies {
			if c.Dst == plan.G1 {
				direct = append(direct, c)
			} else {
				staging = append(staging, c)
			}
		}
	}
	downloads, staging := splitDownloads(staging)
	if errs := w.runDownloads(downloads, saltOf); countErrs(errs) > 0 {
		w.logFailures("G4 download", downloads, errs)
	}
	if errs := w.runOps(staging, nil); countErrs(errs) > 0 {
		w.logFailures("staging load", staging, errs)
	}
	errs := w.runOps(direct, rows)
	for i, err := range errs {
		if err != nil {
			failed = append(failed, direct[i].DstBlock)
		}
	}
	if len(failed) > 0 {
		w.logFailures("load", direct, errs)
	}
	return failed
}

// WaitForSave runs the bound step's Saves (G1→G2, or G1→G3 in disk-only
// mode) and returns when they are done; the engine may overwrite the G1
// blocks afterwards. The step's Moves (G2→G3) are queued and run in the
// background (moves.go): the step does not wait for the disk, unless a Save
// writes a block a queued move still reads or writes. A failed copy leaves
// its destination invalid (a later load of it fails); it is logged, not
// returned: the engine must keep running.
func (w *Worker) WaitForSave() {
	w.lockExec()
	defer w.unlockExec()
	w.mu.Lock()
	s := w.step
	if s == nil || w.savesRun || w.closed {
		w.mu.Unlock()
		return
	}
	w.savesRun = true
	w.saves.Add(1)
	// The moves go first, as if they ran before the saves: a save into a
	// block they hold waits for them.
	w.queueMovesLocked(s.Moves)
	if len(s.Saves) > 0 && w.moves.running && w.copiesConflictLocked(s.Saves) {
		w.waitMovesLocked()
	}
	w.mu.Unlock()
	defer w.saves.Done()
	if len(s.Saves) > 0 {
		w.fence("save")
	}
	if errs := w.runOps(s.Saves, s.G1Groups.Map()); countErrs(errs) > 0 {
		w.logFailures("save", s.Saves, errs)
	}
	w.queueUploads(s.Uploads, s.SaltOf())
	w.mu.Lock()
	if s.Seq > w.savedSeq {
		w.savedSeq = s.Seq
		w.savedChangedLocked()
	}
	w.mu.Unlock()
}

// Run executes a step outside the engine's per-step calls: an operation the
// leader sent over the side channel (G2→G3 moves) rather than inside the
// engine's connector metadata. It runs the step's Drops, Loads
// (synchronously: copies into G2 first, then into G1), Moves and Saves, and
// returns the G1 blocks whose loads failed. Its results never reach Finished,
// and it neither binds the step nor touches the bound one, so the engine's
// own sequence (Bind → StartLoad → WaitForSave → Finished) is unaffected.
//
// Ordering:
//
//   - s.Seq > 0 names the engine step this operation must follow: Run first
//     waits until this worker finished the Saves (and queued the Moves) of
//     the bound step with that Seq (or a later one). The leader plans a background G2→G3 move as
//     soon as the source's save is planned, which may be before this rank
//     has run that save; copying earlier would copy the block's previous
//     contents. The wait ends early (with an error) when the worker closes,
//     or when ctx ends (the error wraps ctx.Err(); the worker is untouched).
//     s.Seq == 0: no wait.
//   - Then Run holds the worker's execution lock for the rest of its
//     duration, and Bind, StartLoad (until its loads are launched) and
//     WaitForSave take the same lock, so a Run happens entirely before or
//     entirely after each of them. It may overlap only the engine's
//     asynchronous loads launched by an earlier StartLoad, which is safe
//     because the leader never hands a block that a running load reads or
//     writes to another operation (load sources stay pinned until the engine
//     reports the load finished). A Run may delay the engine's WaitForSave
//     by its own duration, so background operations should stay small.
//   - Moves the engine's steps queued (moves.go) that hold a block s drops,
//     writes or reads from G3 run first, as for a bound step.
//
// ctx bounds the waits before the step starts (for the engine step's saves,
// then for the execution lock); once its copies start they run to the end.
//
// err is non-nil when the step could not run (worker closed, KV caches not
// registered, ctx ended) or when any of its Moves or Saves failed: their destinations
// hold no valid bytes on this rank, so the leader must not register them.
// Failed loads are reported through loadErrors only.
func (w *Worker) Run(ctx context.Context, s *plan.Step) (loadErrors []int64, err error) {
	if s == nil {
		return nil, errors.New("worker: run step: nil step")
	}
	w.mu.Lock()
	for s.Seq > w.savedSeq && !w.closed {
		saved := w.saved
		w.mu.Unlock()
		select {
		case <-saved:
		case <-ctx.Done():
			return nil, fmt.Errorf("worker: rank %d: run step: waiting for step %d's saves: %w", w.opts.Rank, s.Seq, ctx.Err())
		}
		w.mu.Lock()
	}
	w.mu.Unlock()

	if err := w.lockExecContext(ctx); err != nil {
		return nil, fmt.Errorf("worker: rank %d: run step: waiting for the engine's step calls: %w", w.opts.Rank, err)
	}
	defer w.unlockExec()
	w.mu.Lock()
	switch {
	case w.closed:
		w.mu.Unlock()
		return nil, fmt.Errorf("worker: rank %d: run step: worker is closed", w.opts.Rank)
	case w.g1 == nil:
		w.mu.Unlock()
		return nil, fmt.Errorf("worker: rank %d: run step: KV caches not registered yet", w.opts.Rank)
	}
	w.saves.Add(1) // Close waits for it before unmapping the regions
	w.mu.Unlock()
	defer w.saves.Done()

	w.settleMoves(s) // as Bind: the engine steps' queued moves first, where they touch s's blocks
	w.applyDrops(s.Drops)
	w.stageTags(s)
	if len(s.Loads) > 0 {
		w.fence("load")
		loadErrors = w.execLoads(s.Loads, s.G1Groups.Map(), s.SaltOf())
	}
	if len(s.Saves) > 0 {
		w.fence("save")
	}
	var failed []error
	if errs := w.runOps(s.Moves, nil); countErrs(errs) > 0 {
		w.logFailures("move", s.Moves, errs)
		failed = append(failed, fmt.Errorf("%d of %d moves failed: %w", countErrs(errs), len(s.Moves), firstErr(errs))) // errprefix: wrapped by Run's error below
	}
	if errs := w.runOps(s.Saves, s.G1Groups.Map()); countErrs(errs) > 0 {
		w.logFailures("save", s.Saves, errs)
		failed = append(failed, fmt.Errorf("%d of %d saves failed: %w", countErrs(errs), len(s.Saves), firstErr(errs))) // errprefix: wrapped by Run's error below
	}
	w.queueUploads(s.Uploads, s.SaltOf())
	if len(failed) > 0 {
		return loadErrors, fmt.Errorf("worker: rank %d: run step: %w", w.opts.Rank, errors.Join(failed...))
	}
	return loadErrors, nil
}

func firstErr(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// Finished returns the requests whose loads completed since the last call,
// and the G1 blocks among them whose data could not be loaded (the engine
// must recompute those). A request appears in loaded even if some of its
// blocks failed.
func (w *Worker) Finished() (loaded []string, loadErrorG1Blocks []int64) {
	f := w.FinishedLoads()
	return f.Loaded, f.Errors
}

// FinishedLoads is Finished with, in addition, the requests among Loaded
// whose load failed for at least one G1 block (an engine that cannot map
// failed blocks to requests, vLLM with several KV cache groups, fails those
// requests whole).
type FinishedLoads struct {
	_msgpack struct{} `msgpack:",as_array"`
	Loaded   []string
	Errors   []int64
	Failed   []string
}

// FinishedLoads returns the loads completed since the last call (of it or
// of Finished).
func (w *Worker) FinishedLoads() FinishedLoads {
	w.mu.Lock()
	defer w.mu.Unlock()
	f := FinishedLoads{Loaded: w.loaded, Errors: w.loadErrs, Failed: w.loadFailedReqs}
	w.loaded, w.loadErrs, w.loadFailedReqs = nil, nil, nil
	return f
}

// WaitLoads blocks until every started load has completed.
func (w *Worker) WaitLoads() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waitLoadsLocked()
}
