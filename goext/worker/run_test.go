package worker

import (
	"context"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
)

// TestRunOutsideEngineSteps: a side-channel step runs to completion in Run,
// moves bytes exactly as a bound step would, and its results never show up in
// the engine's Finished; the engine's bound step is left as it was.
func TestRunOutsideEngineSteps(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 8, DiskBlocks: 8, DiskDir: t.TempDir(), BatchSize: 2})
	want := [][]byte{g.block(5), g.block(6)}

	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{5, 6}, plan.G2, []int64{0, 1})})
	require.Empty(t, failed)

	// The engine binds step 2 (a load from G2) but has not started it yet.
	b, err := (&plan.Step{Seq: 2, Loads: []plan.Load{{ReqID: "engine", Copies: copies(plan.G2, []int64{0}, plan.G1, []int64{30})}}}).Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(b))

	tests := []struct {
		name     string
		step     *plan.Step
		wantErrs []int64
	}{
		{"g2 to g3 moves after engine step 1", &plan.Step{Seq: 1, Moves: copies(plan.G2, []int64{0, 1}, plan.G3, []int64{4, 2})}, nil},
		{"load from disk", &plan.Step{Loads: []plan.Load{{ReqID: "wire", Copies: copies(plan.G3, []int64{4, 2}, plan.G1, []int64{20, 21})}}}, nil},
		{"load from unwritten blocks fails per G1 block", &plan.Step{Loads: []plan.Load{
			{ReqID: "bad", Copies: copies(plan.G2, []int64{7}, plan.G1, []int64{22})},
			{ReqID: "bad-disk", Copies: copies(plan.G3, []int64{7}, plan.G1, []int64{23})},
		}}, []int64{22, 23}},
		{"drop then load fails", &plan.Step{Drops: []plan.Copy{{Src: plan.G3, SrcBlock: 2}},
			Loads: []plan.Load{{ReqID: "dropped", Copies: copies(plan.G3, []int64{2}, plan.G1, []int64{24})}}}, []int64{24}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			errs, err := w.Run(t.Context(), tc.step)
			require.NoError(t, err)
			require.ElementsMatch(t, tc.wantErrs, errs)
		})
	}
	require.Equal(t, want[0], g.block(20), "G3 block 4 holds G1 block 5's bytes")
	require.Equal(t, want[1], g.block(21), "G3 block 2 held G1 block 6's bytes")

	loaded, failed := w.Finished()
	require.Empty(t, loaded, "Run's loads are not the engine's")
	require.Empty(t, failed)

	// The engine's bound step still runs, and only it is reported.
	w.StartLoad()
	w.WaitForSave()
	w.WaitLoads()
	loaded, failed = w.Finished()
	require.Equal(t, []string{"engine"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, want[0], g.block(30))
}

func TestRunErrors(t *testing.T) {
	t.Run("failed move fails the step", func(t *testing.T) {
		g := newG1(t, layout.CPU)
		w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir()})
		errs, err := w.Run(t.Context(), &plan.Step{Moves: copies(plan.G2, []int64{0, 3}, plan.G3, []int64{0, 1})})
		require.Empty(t, errs)
		require.ErrorIs(t, err, ErrNotValid)
		require.ErrorContains(t, err, "worker: rank 0: run step: 2 of 2 moves failed")
		require.Equal(t, 1, strings.Count(err.Error(), "worker: "), "the package is named once: %s", err)
		errs, err = w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{0}, plan.G1, []int64{1})}}})
		require.NoError(t, err, "load failures are per G1 block, not a step error")
		require.Equal(t, []int64{1}, errs, "the failed move left its destination invalid")
	})

	g := newG1(t, layout.CPU)
	w, err := New(Options{HostBlocks: 4})
	require.NoError(t, err)
	_, err = w.Run(t.Context(), &plan.Step{})
	require.ErrorContains(t, err, "KV caches not registered")
	_, err = w.Run(t.Context(), nil)
	require.ErrorContains(t, err, "nil step")
	require.NoError(t, w.RegisterG1(g.e))
	require.NoError(t, w.Close())
	_, err = w.Run(t.Context(), &plan.Step{})
	require.ErrorContains(t, err, "worker: rank 0: run step: worker is closed")
}

// TestRunConcurrentWithEngineSteps: Run from another goroutine (the side
// channel's receive loop) while the engine runs its step sequence; the race
// detector checks the serialisation, the bytes check the results.
func TestRunConcurrentWithEngineSteps(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 16, DiskBlocks: 16, DiskDir: t.TempDir(), BatchSize: 2})
	want := make([][]byte, 8)
	for i := range want {
		want[i] = g.block(int64(i))
	}
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{0, 1, 2, 3, 4, 5, 6, 7}, plan.G2, []int64{0, 1, 2, 3, 4, 5, 6, 7})})
	require.Empty(t, failed)

	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range int64(8) {
			errs, err := w.Run(t.Context(), &plan.Step{Moves: copies(plan.G2, []int64{i}, plan.G3, []int64{i})})
			if err != nil || len(errs) > 0 {
				t.Errorf("run %d: %v %v", i, errs, err)
			}
		}
	}()
	for i := range int64(8) {
		// Engine steps write other G2 blocks meanwhile.
		_, failed := run(t, w, &plan.Step{Seq: uint64(2 + i), Saves: copies(plan.G1, []int64{10 + i}, plan.G2, []int64{8 + i})})
		require.Empty(t, failed)
	}
	wg.Wait()
	errs, err := w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{0, 1, 2, 3, 4, 5, 6, 7}, plan.G1, []int64{30, 31, 32, 33, 34, 35, 36, 37})}}})
	require.NoError(t, err)
	require.Empty(t, errs)
	for i := range int64(8) {
		require.Equal(t, want[i], g.block(30+i))
	}
}

// TestRunWaitsForTheEngineStepsSaves: a side-channel move of a G2 block saved
// by engine step 2 runs only after this worker ran step 2's saves, so it
// copies the new bytes, not the block's previous contents.
func TestRunWaitsForTheEngineStepsSaves(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir()})
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	want := g.block(2)
	b, err := (&plan.Step{Seq: 2, Saves: copies(plan.G1, []int64{2}, plan.G2, []int64{0})}).Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(b))
	w.StartLoad()

	done := make(chan error, 1)
	go func() {
		_, err := w.Run(t.Context(), &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{3})})
		done <- err
	}()
	for range 100 {
		runtime.Gosched()
		select {
		case err := <-done:
			t.Fatalf("Run finished before step 2's saves ran: %v", err)
		default:
		}
	}
	w.WaitForSave() // the forward pass is done; step 2's save runs, then the move
	require.NoError(t, <-done)
	errs, err := w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{3}, plan.G1, []int64{9})}}})
	require.NoError(t, err)
	require.Empty(t, errs)
	require.Equal(t, want, g.block(9))

	// A Run waiting for a step that never comes ends when the worker closes.
	go func() {
		_, err := w.Run(t.Context(), &plan.Step{Seq: 99})
		done <- err
	}()
	require.NoError(t, w.Close())
	require.ErrorContains(t, <-done, "worker is closed")
}

// A step with nothing to save (an engine step without a forward pass, which
// may never reach WaitForSave) does not hold back a side-channel operation
// planned after it.
func TestRunAfterAStepWithNothingToSave(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir()})
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	b, err := (&plan.Step{Seq: 2}).Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(b)) // and no StartLoad / WaitForSave follows

	done := make(chan error, 1)
	go func() {
		_, err := w.Run(t.Context(), &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{3})})
		done <- err
	}()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatal("Run waited for the saves of a step that has none")
	}
	errs, err := w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{3}, plan.G1, []int64{9})}}})
	require.NoError(t, err)
	require.Empty(t, errs)
	require.Equal(t, g.block(1), g.block(9))
}

// TestRunCancelled: a Run waiting for an engine step's saves returns
// ctx.Err() when its context ends, runs nothing, and leaves the worker
// working: the step's saves and a later Run proceed as usual. The same holds
// for a Run waiting for the execution lock.
func TestRunCancelled(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir()})
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	b, err := (&plan.Step{Seq: 2, Saves: copies(plan.G1, []int64{2}, plan.G2, []int64{0})}).Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(b))
	w.StartLoad()

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := w.Run(ctx, &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{3})})
		done <- err
	}()
	for range 100 {
		runtime.Gosched()
		select {
		case err := <-done:
			t.Fatalf("Run finished before step 2's saves ran: %v", err)
		default:
		}
	}
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorContains(t, err, "waiting for step 2's saves")
	case <-time.After(time.Minute):
		t.Fatal("a cancelled Run kept waiting for the step's saves")
	}

	// The cancelled move never ran: G3 block 3 holds nothing.
	errs, err := w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{3}, plan.G1, []int64{9})}}})
	require.NoError(t, err)
	require.Equal(t, []int64{9}, errs)

	// The worker is not closed: step 2's saves run, then the same move does.
	w.WaitForSave()
	_, err = w.Run(t.Context(), &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{3})})
	require.NoError(t, err)
	errs, err = w.Run(t.Context(), &plan.Step{Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{3}, plan.G1, []int64{10})}}})
	require.NoError(t, err)
	require.Empty(t, errs)
	require.Equal(t, g.block(2), g.block(10))

	// Waiting for the execution lock (held here as an engine call holds it).
	w.lockExec()
	ctx, cancel = context.WithCancel(t.Context())
	go func() {
		_, err := w.Run(ctx, &plan.Step{Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{1})})
		done <- err
	}()
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(time.Minute):
		t.Fatal("a cancelled Run kept waiting for the execution lock")
	}
	w.unlockExec()
	_, err = w.Run(t.Context(), &plan.Step{Moves: copies(plan.G2, []int64{0}, plan.G3, []int64{1})})
	require.NoError(t, err)
}
