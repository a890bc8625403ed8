package leader

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Broadcaster is the leader⇄worker side channel as the background loop uses
// it (satisfied by wire.Coordinator): Broadcast runs an encoded plan.Step on
// every tensor-parallel rank and returns once all acknowledged it (or the
// first error naming a rank); DeadRanks are ranks whose process is gone for
// good; SuspectRanks are ranks silent for a while, re-admitted when they
// answer again.
type Broadcaster interface {
	Broadcast(ctx context.Context, step []byte) error
	DeadRanks() []int
	SuspectRanks() []int
}

// DefaultBroadcastTimeout bounds one background operation when
// Options.BroadcastTimeout is 0.
const DefaultBroadcastTimeout = 60 * time.Second

// The background loop (Options.SideChannel set; design §2, tensor
// parallelism) runs PlanBackground → Broadcast → CommitBackground in one
// goroutine owned by the leader:
//
//   - each Step wakes it (a non-blocking signal: wakes while it is busy
//     collapse into one);
//   - at most one operation is in flight; nothing new starts while a rank is
//     suspect (its moves wait in the queue until it answers again);
//   - on every wake, and after a failed operation, it asks the side channel
//     for dead ranks: any → SetDegraded, and the operation in flight is
//     committed failed at once (its broadcast is cancelled: the live ranks may
//     be waiting for a step that never comes);
//   - a broadcast is bounded by Options.BroadcastTimeout;
//   - every ticket is committed exactly once, by this goroutine;
//   - Close cancels the operation in flight (committed failed) and joins the
//     loop and its broadcast.
//
// The broadcast itself runs in a second goroutine so that the loop keeps
// answering wakes (dead-rank checks) while it waits.

type sideChannel struct {
	b       Broadcaster
	timeout time.Duration
	wake    chan struct{} // capacity 1: Step's non-blocking signal
	cancel  context.CancelFunc
	done    chan struct{}  // closed when the loop and every broadcast it started returned
	flights sync.WaitGroup // broadcast goroutines

	mu        sync.Mutex // guards the counters below
	committed uint64     // operations every rank acknowledged
	failed    uint64     // operations committed failed (error, timeout, dead rank, close)
	lastErr   string
}

// flight is the operation in flight.
type flight struct {
	ticket uint64
	cancel context.CancelFunc
	result chan error // capacity 1: the broadcast goroutine never blocks
}

// SideChannelStats are the background loop's counters (Options.SideChannel).
type SideChannelStats struct {
	Committed uint64 // operations every rank acknowledged (their G3 blocks registered)
	Failed    uint64 // operations committed failed (their blocks freed, moves requeued)
	LastError string // the last failure, "" if none
}

// SideChannelStats returns the background loop's counters; ok is false
// without Options.SideChannel.
func (l *Leader) SideChannelStats() (s SideChannelStats, ok bool) {
	sc := l.sc
	if sc == nil {
		return s, false
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	return SideChannelStats{Committed: sc.committed, Failed: sc.failed, LastError: sc.lastErr}, true
}

func (l *Leader) startSideChannel(b Broadcaster, timeout time.Duration) {
	if timeout <= 0 {
		timeout = DefaultBroadcastTimeout
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.sc = &sideChannel{b: b, timeout: timeout, wake: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	go l.sideChannelLoop(ctx)
}

// wakeSideChannel is Step's signal to the loop; it never blocks.
func (l *Leader) wakeSideChannel() {
	if l.sc == nil {
		return
	}
	select {
	case l.sc.wake <- struct{}{}:
	default: // a wake is already pending
	}
}

// Close stops the background loop (an operation in flight is cancelled and
// committed failed) and waits for it, and stops G4's registry events. The leader's other methods keep
// working; Close is idempotent.
func (l *Leader) Close() {
	l.stopLifecycle()
	l.closePolicy()
	l.StopG4Events()
	if l.sc == nil {
		return
	}
	l.sc.cancel()
	<-l.sc.done
}

func (l *Leader) sideChannelLoop(ctx context.Context) {
	sc := l.sc
	defer close(sc.done)
	defer sc.flights.Wait() // a broadcast failed early (dead rank) may still be returning
	var f *flight
	for {
		var result <-chan error
		if f != nil {
			result = f.result
		}
		select {
		case <-ctx.Done():
			if f != nil {
				f.cancel()
				err := <-f.result
				l.finishFlight(f, fmt.Errorf("leader: closed: %w", err))
			}
			return
		case err := <-result:
			f.cancel()
			l.finishFlight(f, err)
			f = nil
			if err != nil {
				l.checkDeadRanks(nil)
			}
		case <-sc.wake:
			if l.checkDeadRanks(f) {
				f = nil
			}
			if f == nil {
				f = l.startFlight(ctx)
			}
		}
	}
}

// checkDeadRanks degrades the leader when the side channel reports dead
// ranks, failing f (if any) at once; it reports whether f was committed.
// The broadcast goroutine of f is cancelled; its result is dropped.
func (l *Leader) checkDeadRanks(f *flight) bool {
	dead := l.sc.b.DeadRanks()
	if len(dead) == 0 {
		return false
	}
	l.SetDegraded(dead)
	if f == nil {
		return false
	}
	f.cancel() // its result is dropped (f.result is buffered); Close still joins it
	l.finishFlight(f, fmt.Errorf("leader: tensor-parallel rank(s) %v died", dead))
	return true
}

// startFlight plans the next background operation and starts broadcasting
// it; nil when there is nothing to do, a rank is suspect, or planning failed.
func (l *Leader) startFlight(ctx context.Context) *flight {
	sc := l.sc
	if len(sc.b.SuspectRanks()) > 0 {
		return nil // its moves wait in the queue until every rank answers
	}
	step, ticket, err := l.PlanBackground()
	if err != nil {
		l.log.Warn("kvbm: background operation not started", "err", err)
		sc.mu.Lock()
		sc.lastErr = err.Error()
		sc.mu.Unlock()
		return nil
	}
	if step == nil {
		return nil
	}
	bctx, cancel := context.WithTimeout(ctx, sc.timeout)
	f := &flight{ticket: ticket, cancel: cancel, result: make(chan error, 1)}
	sc.flights.Add(1)
	go func() {
		defer sc.flights.Done()
		f.result <- sc.b.Broadcast(bctx, step)
	}()
	return f
}

// finishFlight commits f: ok when err is nil.
func (l *Leader) finishFlight(f *flight, err error) {
	sc := l.sc
	if cerr := l.CommitBackground(f.ticket, err == nil); cerr != nil {
		// Only this goroutine commits loop tickets: an error here is a bug.
		err = errors.Join(err, cerr)
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if err == nil {
		sc.committed++
		return
	}
	sc.failed++
	sc.lastErr = err.Error()
	l.log.Warn("kvbm: background operation failed; its disk blocks are freed", "ticket", f.ticket, "err", err)
}
