package leader

import (
	"sync/atomic"

	"github.com/kvbm/kvbm/goext/policy"
)

// Quiet steps. Most decode steps give the leader nothing to do: no request
// is new, resumed or allocates a block, none completes a block, and nothing
// the leader queued earlier (G2→G3 moves, drops, loads, uploads, a save to
// retry) waits for a step. An engine adapter may then leave the step out:
// the next step it does send carries the tokens in between (a row's
// new_tokens are whatever the leader has not seen) and the current
// num_computed, which is all planSaves reads. Whether the leader waits for
// a step is kept in a word the adapter reads without calling in
// (PublishStepNeeded), updated whenever mu is released.

// unlock publishes whether the next step is needed, then releases mu.
func (l *Leader) unlock() {
	if w := l.stepWord; w != nil {
		var v int64
		if l.stepNeededLocked() {
			v = 1
		}
		w.Store(v)
	}
	l.mu.Unlock()
}

// PublishStepNeeded makes w follow StepNeeded from now on: 1 while the
// leader waits for a step, 0 otherwise.
func (l *Leader) PublishStepNeeded(w *atomic.Int64) {
	l.mu.Lock()
	l.stepWord = w
	l.unlock()
}

// StepNeeded reports whether the leader has work for the next step even if
// no request in it is new, resumed, allocates a block or completes one.
func (l *Leader) StepNeeded() bool {
	l.mu.Lock()
	defer l.unlock()
	return l.stepNeededLocked()
}

// stepNeededLocked: mu held.
func (l *Leader) stepNeededLocked() bool {
	pendingMoves := l.moves.Len() > 0 && !l.bgMode && !l.degraded && l.host != nil && l.disk != nil
	timed := l.pol.model != nil && (len(l.pol.finished) > 0 || l.pol.load.Mode != policy.Always)
	g4 := l.g4 != nil && len(l.g4.release) > 0
	return pendingMoves || timed || g4 || l.saveRetry || len(l.drops) > 0 || len(l.planned) > 0 ||
		len(l.pol.pending) > 0 || len(l.written) > 0 || len(l.moveSrc) > 0
}
