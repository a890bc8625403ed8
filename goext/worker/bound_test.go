package worker

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
)

// TestBindPlanTellsTheAdapterWhatToActOn: the engine adapter never decodes
// a plan: binding answers with each load's G1 blocks and which calls have
// work, and FinishedLoads names the requests with a failed block.
func TestBindPlanTellsTheAdapterWhatToActOn(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 8})
	save, err := (&plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2}, plan.G2, []int64{0, 1})}).Encode()
	require.NoError(t, err)
	b, err := w.BindPlan(save)
	require.NoError(t, err)
	require.Equal(t, Bound{Save: true}, b)
	w.WaitForSave()

	load := &plan.Step{Seq: 2, Loads: []plan.Load{
		{ReqID: "a", Copies: copies(plan.G2, []int64{0, 1}, plan.G1, []int64{5, 6})},
		{ReqID: "b", Copies: copies(plan.G2, []int64{7}, plan.G1, []int64{9})}, // never written: fails
	}}
	enc, err := load.Encode()
	require.NoError(t, err)
	b, err = w.BindPlan(enc)
	require.NoError(t, err)
	require.Equal(t, Bound{Start: true, Loads: []BoundLoad{{ReqID: "a", G1: []int64{5, 6}}, {ReqID: "b", G1: []int64{9}}}}, b)
	w.StartLoad()
	w.WaitLoads()
	f := w.FinishedLoads()
	slices.Sort(f.Loaded)
	require.Equal(t, []string{"a", "b"}, f.Loaded)
	require.Equal(t, []int64{9}, f.Errors)
	require.Equal(t, []string{"b"}, f.Failed)
	require.Empty(t, w.FinishedLoads().Loaded, "reported once")

	empty, err := (&plan.Step{Seq: 3}).Encode()
	require.NoError(t, err)
	b, err = w.BindPlan(empty)
	require.NoError(t, err)
	require.True(t, b.Empty())
}
