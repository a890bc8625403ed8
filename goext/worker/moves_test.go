package worker

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
)

// gateDisk wraps the real disk: every write waits until gate is closed (a
// disk that does not answer), and counts the writes that entered.
type gateDisk struct {
	blockDisk
	gate    chan struct{}
	entered atomic.Int32
}

func (d *gateDisk) WriteBlock(i int, buf []byte) error {
	d.entered.Add(1)
	<-d.gate
	return d.blockDisk.WriteBlock(i, buf)
}

// stalled is how long a test lets a step that must wait for a blocked
// move run before it opens the disk: a correct worker passes whatever the
// machine's speed; a worker that does not wait is caught when the step
// gets this far.
const stalled = 200 * time.Millisecond

// hangLimit bounds the wait for a call that must not block at all (the
// test fails instead of hanging when it does).
const hangLimit = 10 * time.Second

func gatedWorker(t *testing.T) (*g1, *Worker, *gateDisk) {
	t.Helper()
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 8, DiskBlocks: 8, DiskDir: t.TempDir(), BatchSize: 1})
	d := &gateDisk{blockDisk: w.disk, gate: make(chan struct{})}
	w.disk = d
	// Registered after newWorker's Close: runs first, so Close never waits
	// for a write the test left blocked.
	t.Cleanup(d.open)
	return g, w, d
}

func (d *gateDisk) open() {
	select {
	case <-d.gate:
	default:
		close(d.gate)
	}
}

// bindSave binds s and runs its engine calls as the engine does, without
// waiting for background moves; done is closed when WaitForSave returned.
func bindSave(t *testing.T, w *Worker, s *plan.Step) (done chan struct{}) {
	t.Helper()
	done = make(chan struct{})
	go func() {
		defer close(done)
		if err := w.Bind(s); err != nil {
			t.Error(err)
			return
		}
		w.StartLoad()
		w.WaitForSave()
	}()
	return done
}

// TestMovesOutsideTheStep: a step's G2→G3 moves do not hold up its
// WaitForSave — with the disk not answering at all, the step's saves land
// and WaitForSave returns; the moves complete once the disk answers.
func TestMovesOutsideTheStep(t *testing.T) {
	g, w, d := gatedWorker(t)
	want := [][]byte{g.block(1), g.block(2), g.block(3)}
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2}, plan.G2, []int64{0, 1})})

	done := bindSave(t, w, &plan.Step{Seq: 2,
		Moves: copies(plan.G2, []int64{0, 1}, plan.G3, []int64{4, 5}),
		Saves: copies(plan.G1, []int64{3}, plan.G2, []int64{2})})
	select {
	case <-done:
	case <-time.After(hangLimit):
		d.open()
		t.Fatal("WaitForSave waited for a G3 write the disk never finished")
	}
	require.Zero(t, w.TransferStats()["g2_to_g3"].Blocks, "the moves are still waiting for the disk")
	require.True(t, w.hostValid[2].Load(), "the step's save ran before WaitForSave returned")

	d.open()
	w.WaitMoves()
	require.Equal(t, uint64(2), w.TransferStats()["g2_to_g3"].Blocks)
	// The G2 copies go; the blocks come back from disk.
	loaded, failed := run(t, w, &plan.Step{Seq: 3,
		Drops: []plan.Copy{{Src: plan.G2, SrcBlock: 0}, {Src: plan.G2, SrcBlock: 1}},
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G3, []int64{4, 5}, plan.G1, []int64{20, 21})}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, want[0], g.block(20))
	require.Equal(t, want[1], g.block(21))
	_, failed = run(t, w, &plan.Step{Seq: 4, Loads: []plan.Load{{ReqID: "s", Copies: copies(plan.G2, []int64{2}, plan.G1, []int64{22})}}})
	require.Empty(t, failed)
	require.Equal(t, want[2], g.block(22))
}

// TestMovesHoldTheirBlocks: a later step that changes a block a queued move
// still reads (its G2 source) or writes (its G3 destination) waits for the
// move, so every step sees the tiers as if the earlier moves had finished.
func TestMovesHoldTheirBlocks(t *testing.T) {
	for _, tc := range []struct {
		name string
		next *plan.Step // step 3; the queued move is G2[0] → G3[4]
		kept bool       // G3[4] holds the move's bytes afterwards
	}{
		{"save overwrites the source", &plan.Step{Seq: 3, Drops: []plan.Copy{{Src: plan.G2, SrcBlock: 0}},
			Saves: copies(plan.G1, []int64{9}, plan.G2, []int64{0})}, true},
		{"load reads the destination", &plan.Step{Seq: 3,
			Loads: []plan.Load{{ReqID: "early", Copies: copies(plan.G3, []int64{4}, plan.G1, []int64{30})}}}, true},
		{"staging overwrites the source", &plan.Step{Seq: 3,
			Loads: []plan.Load{{ReqID: "stage", Copies: copies(plan.G3, []int64{6}, plan.G2, []int64{0})}}}, true},
		{"drop of the destination", &plan.Step{Seq: 3, Drops: []plan.Copy{{Src: plan.G3, SrcBlock: 4}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, w, d := gatedWorker(t)
			want := g.block(1)
			run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G2, []int64{0})})
			done := bindSave(t, w, &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{4})})
			select {
			case <-done:
			case <-time.After(hangLimit):
				d.open()
				t.Fatal("WaitForSave waited for a G3 write the disk never finished")
			}
			third := bindSave(t, w, tc.next)
			select {
			case <-third:
				d.open()
				t.Fatal("a step touching a block of a queued move ran before the move")
			case <-time.After(stalled):
			}
			d.open()
			<-third
			w.WaitLoads()
			_, failed := w.Finished()
			require.Empty(t, failed)
			if len(tc.next.Loads) > 0 && tc.next.Loads[0].Copies[0].Dst == plan.G1 {
				require.Equal(t, want, g.block(30))
			}
			_, failed = run(t, w, &plan.Step{Seq: 4, Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G3, []int64{4}, plan.G1, []int64{20})}}})
			if !tc.kept {
				require.Equal(t, []int64{20}, failed, "a dropped block is never served")
				return
			}
			require.Empty(t, failed)
			require.Equal(t, want, g.block(20))
		})
	}
}
