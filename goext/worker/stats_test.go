package worker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// TestTransferStatsPerWorker: each worker keeps its own per-direction
// totals (blocks, bytes, timed batches), even when workers share one
// Prometheus set, as the workers of one process do.
func TestTransferStatsPerWorker(t *testing.T) {
	shared := metrics.New()
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 16, DiskBlocks: 8, DiskDir: t.TempDir(), BatchSize: 2, Metrics: shared})
	g2 := newG1(t, layout.FlashAttn)
	other := newWorker(t, g2, Options{HostBlocks: 16, DiskBlocks: 8, DiskDir: t.TempDir(), BatchSize: 2, Metrics: shared})
	bpb := uint64(g.e.BytesPerBlock())

	require.Empty(t, w.TransferStats())
	require.Zero(t, w.TransferSeq())
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2, 3}, plan.G2, []int64{4, 5, 6})})
	require.Empty(t, failed)
	require.Equal(t, uint64(2), w.TransferSeq(), "one per batch recorded")
	_, failed = run(t, w, &plan.Step{Seq: 2})
	require.Empty(t, failed)
	require.Equal(t, uint64(2), w.TransferSeq(), "a step without copies records nothing")
	_, failed = run(t, w, &plan.Step{Seq: 3, Moves: copies(plan.G2, []int64{4, 5}, plan.G3, []int64{0, 1})})
	require.Empty(t, failed)
	w.WaitMoves()
	require.Equal(t, uint64(3), w.TransferSeq())
	_, failed = run(t, other, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{7}, plan.G2, []int64{0})})
	require.Empty(t, failed)

	st := w.TransferStats()
	d2h := st["g1_to_g2"]
	require.Equal(t, uint64(3), d2h.Blocks)
	require.Equal(t, 3*bpb, d2h.Bytes)
	require.Equal(t, uint64(2), d2h.Batches, "3 blocks in batches of at most 2")
	require.Zero(t, d2h.Failed)
	require.GreaterOrEqual(t, d2h.Seconds, 0.0)
	require.Equal(t, uint64(2), st["g2_to_g3"].Blocks)
	require.Equal(t, 2*bpb, st["g2_to_g3"].Bytes)
	require.Len(t, st, 2)
	require.Equal(t, uint64(1), other.TransferStats()["g1_to_g2"].Blocks, "the other worker's own totals")
}

// TestTransferTimingsForTheLeader: rank 0's worker keeps its timed load
// batches (not saves or moves) for a leader in another process, handed out
// once; another rank's are dropped; a leader's model fed with them
// measures the tier directly.
func TestTransferTimingsForTheLeader(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 16, BatchSize: 2, Metrics: metrics.New()})
	bpb := int64(g.e.BytesPerBlock())
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2, 3}, plan.G2, []int64{4, 5, 6})})
	require.Empty(t, failed)
	require.Empty(t, w.TakeTransferTimings(), "saves are not loads")
	loaded, failed := run(t, w, &plan.Step{Seq: 2,
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{4, 5, 6}, plan.G1, []int64{7, 8, 9})}}})
	require.Empty(t, failed)
	require.Equal(t, []string{"r"}, loaded)
	ts := w.TakeTransferTimings()
	require.Len(t, ts, 2, "3 blocks in batches of at most 2")
	var bytes int64
	for _, x := range ts {
		require.Equal(t, "g2_to_g1", x.Dir)
		require.GreaterOrEqual(t, x.Seconds, 0.0)
		bytes += x.Bytes
	}
	require.Equal(t, 3*bpb, bytes)
	require.Empty(t, w.TakeTransferTimings(), "handed out once")

	m := policy.NewModel(0)
	m.ObserveTimings(ts)
	require.Equal(t, uint64(2), m.Snapshot().Measured[plan.G2])

	g1 := newG1(t, layout.FlashAttn)
	r1 := newWorker(t, g1, Options{Rank: 1, HostBlocks: 16, Metrics: metrics.New()})
	_, failed = run(t, r1, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G2, []int64{4})})
	require.Empty(t, failed)
	_, failed = run(t, r1, &plan.Step{Seq: 2,
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{4}, plan.G1, []int64{7})}}})
	require.Empty(t, failed)
	require.Empty(t, r1.TakeTransferTimings(), "rank 0's timings measure the load")
}
