package leader

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/plan"
)

// bcastCall is one Broadcast the fake received; the test answers it.
type bcastCall struct {
	ctx   context.Context
	step  *plan.Step
	reply chan error
}

// fakeBroadcaster hands every Broadcast to the test (calls) and waits for
// the test's reply or its context.
type fakeBroadcaster struct {
	calls chan *bcastCall

	mu      sync.Mutex
	dead    []int
	suspect []int
	asked   chan struct{} // one value per SuspectRanks call (the loop deciding to start)
}

func newFakeBroadcaster() *fakeBroadcaster {
	return &fakeBroadcaster{calls: make(chan *bcastCall, 16), asked: make(chan struct{}, 64)}
}

func (f *fakeBroadcaster) Broadcast(ctx context.Context, step []byte) error {
	st, err := plan.Decode(step)
	if err != nil {
		return err
	}
	c := &bcastCall{ctx: ctx, step: st, reply: make(chan error, 1)}
	f.calls <- c
	select {
	case err := <-c.reply:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fakeBroadcaster) DeadRanks() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.dead)
}

func (f *fakeBroadcaster) SuspectRanks() []int {
	f.mu.Lock()
	r := slices.Clone(f.suspect)
	f.mu.Unlock()
	f.asked <- struct{}{}
	return r
}

func (f *fakeBroadcaster) set(dead, suspect []int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dead, f.suspect = dead, suspect
}

// next waits for the next Broadcast.
func (f *fakeBroadcaster) next(t *testing.T) *bcastCall {
	t.Helper()
	select {
	case c := <-f.calls:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no background operation was broadcast")
		return nil
	}
}

// lockedBuf and lockedSink are written by the loop's goroutine and read by the test.
type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type lockedSink struct {
	mu  sync.Mutex
	evs []events.BlockEvent
}

func (s *lockedSink) Publish(ev events.BlockEvent) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.evs = append(s.evs, ev)
}

func (s *lockedSink) diskStored() []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	stored, _ := diskEvents(s.evs)
	return stored
}

type scEnv struct {
	*env
	b    Broadcaster
	sink *lockedSink
	logs *lockedBuf
}

// newScEnv: host/disk of 16 blocks, filter off, the loop running over b.
func newScEnv(t *testing.T, b Broadcaster, timeout time.Duration) *scEnv {
	t.Helper()
	s := &scEnv{b: b, sink: &lockedSink{}, logs: &lockedBuf{}}
	s.env = newEnvWith(t, 16, 16, func(c *config.Config) { c.DisableDiskOffloadFilter = true }, func(o *Options) {
		o.SideChannel, o.BroadcastTimeout, o.Sink = b, timeout, s.sink
		o.Logger = slog.New(slog.NewTextHandler(s.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	t.Cleanup(s.l.Close)
	return s
}

// saveA plans request "a" (two full blocks saved to G2) in one step; that
// step wakes the loop.
func (s *scEnv) saveA(t *testing.T) {
	t.Helper()
	st := s.step(t, RequestUpdate{ReqID: "a", NewTokens: toks(0, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	require.Len(t, st.Saves, 2)
}

func (s *scEnv) stats() SideChannelStats {
	st, ok := s.l.SideChannelStats()
	if !ok {
		panic("no side channel")
	}
	return st
}

// waitFor polls cond until it holds (10 s deadline).
func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	require.Eventually(t, cond, 10*time.Second, 5*time.Millisecond, what)
}

func diskUsed(l *Leader) int {
	_, d := l.BlocksUsed()
	return d
}

func TestSideChannelCommitsAfterEveryRankAcked(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 0)
	s.saveA(t)
	c := b.next(t)
	<-b.asked // saveA's wake
	require.Len(t, c.step.Moves, 2)
	require.Equal(t, uint64(1), c.step.Seq, "runs after the step that saved its sources")
	require.Equal(t, 1, s.l.BackgroundInFlight())
	require.Zero(t, diskUsed(s.l), "not matchable before every rank acked")
	require.Empty(t, s.sink.diskStored(), "not announced before every rank acked")

	c.reply <- nil
	waitFor(t, func() bool { return s.stats().Committed == 1 }, "committed")
	require.Equal(t, 2, diskUsed(s.l))
	require.Zero(t, s.l.BackgroundInFlight())
	require.ElementsMatch(t, seqHashes(toks(0, 8)), s.sink.diskStored())
	require.Equal(t, SideChannelStats{Committed: 1}, s.stats())

	// Nothing queued: a step starts nothing.
	s.step(t)
	<-b.asked
	s.step(t)
	<-b.asked // the loop decided twice; no broadcast
	require.Empty(t, b.calls)
}

func TestSideChannelFailedOperationIsRetried(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 0)
	s.saveA(t)
	c := b.next(t)
	c.reply <- errors.New("rank 1: disk full")
	waitFor(t, func() bool { return s.stats().Failed == 1 }, "failed")
	require.Zero(t, s.l.BackgroundInFlight())
	require.Zero(t, diskUsed(s.l))
	require.Contains(t, s.stats().LastError, "rank 1: disk full")
	require.Contains(t, s.logs.String(), "background operation failed")

	// The moves were requeued: the next step sends them again.
	s.step(t)
	again := b.next(t)
	require.Equal(t, plan.G2, again.step.Moves[0].Src)
	require.ElementsMatch(t, []int64{c.step.Moves[0].SrcBlock, c.step.Moves[1].SrcBlock},
		[]int64{again.step.Moves[0].SrcBlock, again.step.Moves[1].SrcBlock})
	again.reply <- nil
	waitFor(t, func() bool { return s.stats().Committed == 1 }, "committed")
	require.Equal(t, 2, diskUsed(s.l))
	require.Equal(t, uint64(1), s.stats().Failed)
}

func TestSideChannelNothingStartsWhileARankIsSuspect(t *testing.T) {
	b := newFakeBroadcaster()
	b.set(nil, []int{1})
	s := newScEnv(t, b, 0)
	s.saveA(t)
	<-b.asked
	s.step(t)
	<-b.asked // two decisions taken, both while rank 1 was suspect
	require.Empty(t, b.calls)
	require.Zero(t, s.l.BackgroundInFlight())

	b.set(nil, nil) // rank 1 answers again: the queued moves go out
	s.step(t)
	c := b.next(t)
	require.Len(t, c.step.Moves, 2)
	c.reply <- nil
	waitFor(t, func() bool { return diskUsed(s.l) == 2 }, "committed")
}

func TestSideChannelDeadRankMidFlight(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 0)
	s.saveA(t)
	c := b.next(t) // in flight, never answered: rank 1 is gone

	b.set([]int{1}, nil)
	s.step(t) // the loop checks on every wake
	waitFor(t, func() bool { d, _ := s.l.Degraded(); return d }, "degraded")
	waitFor(t, func() bool { return s.stats().Failed == 1 }, "the operation in flight failed")
	_, dead := s.l.Degraded()
	require.Equal(t, []int{1}, dead)
	require.Zero(t, s.l.BackgroundInFlight(), "failed at once, not after its timeout")
	select {
	case <-c.ctx.Done(): // its broadcast was cancelled
	case <-time.After(10 * time.Second):
		t.Fatal("the broadcast in flight was not cancelled")
	}
	require.Zero(t, diskUsed(s.l))
	got, async := s.l.GetNumNewMatchedTokens("b", toks(0, 9), 0, 0)
	require.Equal(t, 0, got, "degraded: nothing matched")
	require.False(t, async)

	s.step(t)
	s.step(t)
	require.Empty(t, b.calls, "degraded: nothing more is sent")
}

func TestSideChannelCloseWhileInFlight(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 0)
	s.saveA(t)
	c := b.next(t)
	s.l.Close() // returns only once the loop and its broadcast returned
	require.ErrorIs(t, c.ctx.Err(), context.Canceled)
	require.Zero(t, s.l.BackgroundInFlight())
	require.Equal(t, uint64(1), s.stats().Failed)
	require.Contains(t, s.stats().LastError, "leader: closed")
	require.Zero(t, diskUsed(s.l))
	s.l.Close() // idempotent
	s.step(t)   // the leader still plans; nothing wakes a closed loop
}

func TestSideChannelResetDuringFlight(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 0)
	s.saveA(t)
	c := b.next(t)
	s.l.ResetCache()
	c.reply <- nil // every rank wrote, but the cache was reset since
	waitFor(t, func() bool { return s.stats().Committed == 1 }, "committed")
	require.Zero(t, s.l.BackgroundInFlight())
	require.Zero(t, diskUsed(s.l), "a reset discards what was in flight")
	require.Empty(t, s.sink.diskStored(), "never announced")
}

func TestSideChannelBroadcastIsBounded(t *testing.T) {
	b := newFakeBroadcaster()
	s := newScEnv(t, b, 50*time.Millisecond)
	s.saveA(t)
	c := b.next(t) // never answered
	waitFor(t, func() bool { return s.stats().Failed == 1 }, "timed out")
	require.ErrorIs(t, c.ctx.Err(), context.DeadlineExceeded)
	require.Contains(t, s.stats().LastError, "deadline exceeded")
	require.Zero(t, s.l.BackgroundInFlight())
}

func TestWithoutSideChannel(t *testing.T) {
	e := newEnv(t, 16, 16, nil)
	_, ok := e.l.SideChannelStats()
	require.False(t, ok)
	e.l.Close() // nothing to stop
}

func slogTo(w *lockedBuf) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
