package worker

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/transfer"
)

// newGroupedG1 is a CPU-layout KV cache with two KV cache groups laid out as
// vLLM's hybrid manager does: layers 0 and 2 in group 0, layers 1 and 3 in
// group 1, and layer i of each group sharing one tensor (layers 0 and 1
// tensor A, layers 2 and 3 tensor B), each group using its own blocks.
func newGroupedG1(t *testing.T, kinds ...string) *g1 {
	t.Helper()
	shape := []int64{2, nBlocks, heads, bs, hdim}
	n := int64(2)
	for _, d := range shape {
		n *= d
	}
	g := &g1{rng: rand.New(rand.NewPCG(7, 99))}
	var ts []layout.Tensor
	for i := 0; i < 2; i++ {
		m, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Munmap(m) })
		g.mems = append(g.mems, m)
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: shape})
	}
	// Layer order: 0 (A, g0), 1 (A, g1), 2 (B, g0), 3 (B, g1).
	tensors := []layout.Tensor{ts[0], ts[0], ts[1], ts[1]}
	e, err := layout.NewEngine(layout.Spec{Kind: layout.CPU, Tensors: tensors, NumBlocks: nBlocks, BlockSize: bs,
		DtypeBytes: 2, LayerGroups: []int{0, 1, 0, 1}, GroupKinds: kinds})
	require.NoError(t, err)
	require.Equal(t, 2, e.NumGroups())
	g.e = e
	g.scramble()
	return g
}

// chunk is a copy of G1 chunk (block, layer, outer).
func (g *g1) chunk(b, l, o int) []byte {
	addr := g.e.ChunkAddr(b, l, o)
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return bytes.Clone(unsafe.Slice((*byte)(p), g.e.ChunkBytes))
}

// position is what a stored block must hold for a row: layer l from the
// block of l's group.
func (g *g1) position(row []int64) [][]byte {
	var out [][]byte
	for l := 0; l < g.e.NumLayers; l++ {
		for o := 0; o < g.e.OuterDim; o++ {
			out = append(out, g.chunk(int(row[g.e.LayerGroup(l)]), l, o))
		}
	}
	return out
}

func rows(groups int, rs ...[]int64) *plan.GroupRows {
	return &plan.GroupRows{Groups: groups, Rows: rs}
}

// TestGroupsSaveLoad: a save gathers each layer from its group's block; a
// load writes each layer into its group's block and leaves a group whose
// block is the null block (layout.NoBlock) untouched, through G2 and G3.
func TestGroupsSaveLoad(t *testing.T) {
	g := newGroupedG1(t)
	w := newWorker(t, g, Options{HostBlocks: 8, DiskBlocks: 8, DiskDir: t.TempDir(), MaxConcurrent: 2, BatchSize: 2})
	rowA, rowB := []int64{3, 3, 10}, []int64{7, 7, 11} // primary, group 0, group 1
	wantA, wantB := g.position(rowA[1:]), g.position(rowB[1:])
	_, failed := run(t, w, &plan.Step{Seq: 1, G1Groups: rows(2, rowA, rowB),
		Saves: append(copies(plan.G1, []int64{3, 7}, plan.G2, []int64{0, 1}),
			copies(plan.G1, []int64{3}, plan.G3, []int64{4})...)})
	require.Empty(t, failed)

	g.scramble()
	before := g.snapshot()
	// Position A loads into group 0 only (group 1 has the null block there,
	// as a sliding window's group before its window); B into both.
	loadA, loadB, diskA := []int64{20, 20, layout.NoBlock}, []int64{21, 21, 22}, []int64{30, 30, 31}
	loaded, failed := run(t, w, &plan.Step{Seq: 2, G1Groups: rows(2, loadA, loadB, diskA), Loads: []plan.Load{
		{ReqID: "r", Copies: append(copies(plan.G2, []int64{0, 1}, plan.G1, []int64{20, 21}),
			copies(plan.G3, []int64{4}, plan.G1, []int64{30})...)},
	}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, wantB, g.position(loadB[1:]))
	require.Equal(t, wantA, g.position(diskA[1:]))
	for l := 0; l < g.e.NumLayers; l += 2 { // group 0's layers at block 20
		for o := 0; o < g.e.OuterDim; o++ {
			require.Equal(t, wantA[l*g.e.OuterDim+o], g.chunk(20, l, o), "layer %d", l)
		}
	}
	// Nothing but the loaded chunks changed (a chunk of tensor A at block b
	// is layer 0's when group 0 owns b, layer 1's when group 1 does).
	written := map[[3]int]bool{}
	for _, r := range [][]int64{loadA, loadB, diskA} {
		for l := 0; l < g.e.NumLayers; l++ {
			if b := r[1+g.e.LayerGroup(l)]; b != layout.NoBlock {
				for o := 0; o < g.e.OuterDim; o++ {
					written[[3]int{int(b), l / 2, o}] = true // layers 0, 1 share tensor A; 2, 3 tensor B
				}
			}
		}
	}
	after := g.snapshot()
	for b := 0; b < nBlocks; b++ {
		for l := 0; l < g.e.NumLayers; l++ {
			for o := 0; o < g.e.OuterDim; o++ {
				if written[[3]int{b, l / 2, o}] {
					continue
				}
				_, off := g.e.ChunkOffset(b, l, o)
				tn := l / 2 // layers 0, 1 share tensor A; 2, 3 tensor B
				require.Equal(t, before[tn][off:off+g.e.ChunkBytes], after[tn][off:off+g.e.ChunkBytes],
					"block %d layer %d outer %d", b, l, o)
			}
		}
	}
}

// TestGroupsStateGroup: group 0 keeps recurrent state (layout.StateKind).
// A save of a position without a state (its entry NoBlock) stores the
// attention layers with the state layers zeroed, instead of failing; a save
// with the state stores it; a load writes the state layers only where the
// row names a state block.
func TestGroupsStateGroup(t *testing.T) {
	g := newGroupedG1(t, layout.StateKind, "full_attention")
	require.True(t, g.e.StateGroup(0))
	require.False(t, g.e.StateGroup(1))
	w := newWorker(t, g, Options{HostBlocks: 8, MaxConcurrent: 1, BatchSize: 2})
	plain, withState := []int64{3, layout.NoBlock, 3}, []int64{4, 9, 4}
	wantState := g.position(withState[1:])
	wantPlain := g.position([]int64{3, 3}) // attention layers of block 3 (state layers checked apart)
	_, failed := run(t, w, &plan.Step{Seq: 1, G1Groups: rows(2, plain, withState),
		Saves: copies(plan.G1, []int64{3, 4}, plan.G2, []int64{0, 1})})
	require.Empty(t, failed)
	require.True(t, w.hostValid[0].Load() && w.hostValid[1].Load())

	g.scramble()
	before := g.snapshot()
	// Load the plain position without a state, and the stateful one with its state.
	loadPlain, loadState := []int64{20, layout.NoBlock, 20}, []int64{21, 25, 21}
	loaded, failed := run(t, w, &plan.Step{Seq: 2, G1Groups: rows(2, loadPlain, loadState), Loads: []plan.Load{
		{ReqID: "r", Copies: copies(plan.G2, []int64{0, 1}, plan.G1, []int64{20, 21})}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, wantState, g.position(loadState[1:]))
	for l := 1; l < g.e.NumLayers; l += 2 { // attention layers of the plain position: loaded
		for o := 0; o < g.e.OuterDim; o++ {
			require.Equal(t, wantPlain[l*g.e.OuterDim+o], g.chunk(20, l, o), "layer %d", l)
		}
	}
	// Only blocks 20, 21 (attention) and 25 (state) were written.
	after := g.snapshot()
	for tn := range before {
		for b := 0; b < nBlocks; b++ {
			if b == 20 || b == 21 || b == 25 {
				continue
			}
			for o := 0; o < g.e.OuterDim; o++ {
				_, off := g.e.ChunkOffset(b, 2*tn, o)
				require.Equal(t, before[tn][off:off+g.e.ChunkBytes], after[tn][off:off+g.e.ChunkBytes], "block %d", b)
			}
		}
	}
	// The stored plain position holds zeros in its state layers.
	host := w.host.Block(0)
	hl := g.e.Host()
	for l := 0; l < g.e.NumLayers; l += 2 {
		off := hl.ChunkOffset(l, 0)
		require.Equal(t, make([]byte, g.e.ChunkBytes), host[off:off+g.e.ChunkBytes], "state layer %d", l)
	}
}

// TestGroupsIncompleteSave: a save whose position lacks a group's block
// (or has no row) fails and leaves its destination invalid, so a later load
// of it fails instead of returning another block's bytes.
func TestGroupsIncompleteSave(t *testing.T) {
	g := newGroupedG1(t)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir(), MaxConcurrent: 1, BatchSize: 4})
	_, failed := run(t, w, &plan.Step{Seq: 1, G1Groups: rows(2, []int64{5, 5, 6}),
		Saves: copies(plan.G1, []int64{5}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	require.True(t, w.hostValid[0].Load())
	// Block 0 is reused for a position whose group 1 block is null, block 1
	// and disk block 2 for blocks the rows do not name.
	_, _ = run(t, w, &plan.Step{Seq: 2, G1Groups: rows(2, []int64{8, 8, layout.NoBlock}),
		Saves: append(copies(plan.G1, []int64{8, 9}, plan.G2, []int64{0, 1}),
			copies(plan.G1, []int64{8}, plan.G3, []int64{2})...)})
	require.False(t, w.hostValid[0].Load())
	require.False(t, w.hostValid[1].Load())
	require.False(t, w.diskValid[2].Load())
	_, failed = run(t, w, &plan.Step{Seq: 3, G1Groups: rows(2, []int64{12, 12, 13}, []int64{14, 14, 15}),
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0, 1}, plan.G1, []int64{12, 14})}}})
	require.Equal(t, []int64{12, 14}, failed)
	// A load whose G1 block has no row fails too.
	_, failed = run(t, w, &plan.Step{Seq: 4, Loads: []plan.Load{{ReqID: "r",
		Copies: copies(plan.G3, []int64{2}, plan.G1, []int64{16})}}})
	require.Equal(t, []int64{16}, failed)
}

// TestGroupsOneGroupRows: an engine with one group follows a step's rows
// when it has them: a load into a position without a block writes nothing,
// a save from one fails.
func TestGroupsOneGroupRows(t *testing.T) {
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, Options{HostBlocks: 4, MaxConcurrent: 1, BatchSize: 4})
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{5, 6}, plan.G2, []int64{0, 1})})
	require.Empty(t, failed)
	before := g.snapshot()
	// G1 block 0 stands for the null block, named by both positions.
	_, failed = run(t, w, &plan.Step{Seq: 2, G1Groups: rows(1, []int64{0, layout.NoBlock}),
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0, 1}, plan.G1, []int64{0, 0})}}})
	require.Empty(t, failed)
	require.Equal(t, before, g.snapshot())
	_, _ = run(t, w, &plan.Step{Seq: 3, G1Groups: rows(1, []int64{7, layout.NoBlock}),
		Saves: copies(plan.G1, []int64{7}, plan.G2, []int64{2})})
	require.False(t, w.hostValid[2].Load())
}

// recCopier is a G1Copier over host memory that records the blocks it moves.
type recCopier struct {
	e                 *layout.Engine
	gathered, scatter []int
}

func (c *recCopier) RegisterHost(*storage.HostRegion) error { return nil }
func (c *recCopier) Fence() error                           { return nil }
func (c *recCopier) MaxBatch() int                          { return 0 }
func (c *recCopier) Close() error                           { return nil }
func (c *recCopier) GatherBlocks(blocks []int, dsts [][]byte) error {
	c.gathered = append(c.gathered, blocks...)
	transfer.GatherBlocks(c.e, blocks, dsts)
	return nil
}
func (c *recCopier) ScatterBlocks(blocks []int, srcs [][]byte) error {
	c.scatter = append(c.scatter, blocks...)
	transfer.ScatterBlocks(c.e, blocks, srcs)
	return nil
}

// TestGroupsOneGroupRowsDeviceCopier: with one group, rows reduce to whole
// blocks for the engine's copier (the CUDA one moves whole blocks): a
// position without a block is not handed to it.
func TestGroupsOneGroupRowsDeviceCopier(t *testing.T) {
	g := newG1(t, layout.CPU)
	c := &recCopier{e: g.e}
	w := newWorker(t, g, Options{HostBlocks: 4, MaxConcurrent: 1, BatchSize: 4, G1: c})
	_, failed := run(t, w, &plan.Step{Seq: 1, G1Groups: rows(1, []int64{5, 5}),
		Saves: copies(plan.G1, []int64{5}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	_, failed = run(t, w, &plan.Step{Seq: 2, G1Groups: rows(1, []int64{0, layout.NoBlock}, []int64{9, 9}),
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0, 0}, plan.G1, []int64{0, 9})}}})
	require.Empty(t, failed)
	require.Equal(t, []int{5}, c.gathered)
	require.Equal(t, []int{9}, c.scatter)
	require.Equal(t, g.block(5), g.block(9))
}

// rowCopier is recCopier with per-group copies (a G1RowCopier): it records
// the rows it was handed and moves them with the host reference.
type rowCopier struct {
	recCopier
	gatherRows, scatterRows [][]int64
}

func (c *rowCopier) GatherRows(rows [][]int64, dsts [][]byte) error {
	c.gatherRows = append(c.gatherRows, rows...)
	transfer.GatherRows(c.e, rows, dsts)
	return nil
}

func (c *rowCopier) ScatterRows(rows [][]int64, srcs [][]byte) error {
	c.scatterRows = append(c.scatterRows, rows...)
	transfer.ScatterRows(c.e, rows, srcs)
	return nil
}

// TestGroupsDeviceRowCopier: with several groups, a copier that copies per
// group gets every group's block of each position (the null block included
// for a load), never whole blocks; one that does not fails the copy, and a
// failed load is reported for its request instead of loading wrong layers.
func TestGroupsDeviceRowCopier(t *testing.T) {
	g := newGroupedG1(t)
	c := &rowCopier{recCopier: recCopier{e: g.e}}
	w := newWorker(t, g, Options{HostBlocks: 4, MaxConcurrent: 1, BatchSize: 4, G1: c})
	row := []int64{3, 3, 10}
	want := g.position(row[1:])
	_, failed := run(t, w, &plan.Step{Seq: 1, G1Groups: rows(2, row),
		Saves: copies(plan.G1, []int64{3}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	require.Equal(t, [][]int64{{3, 10}}, c.gatherRows)
	load := []int64{20, 20, layout.NoBlock}
	loaded, failed := run(t, w, &plan.Step{Seq: 2, G1Groups: rows(2, load),
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0}, plan.G1, []int64{20})}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, [][]int64{{20, layout.NoBlock}}, c.scatterRows)
	require.Empty(t, c.gathered)
	require.Empty(t, c.scatter)
	for l := 0; l < g.e.NumLayers; l += 2 { // group 0's layers landed at block 20
		for o := 0; o < g.e.OuterDim; o++ {
			require.Equal(t, want[l*g.e.OuterDim+o], g.chunk(20, l, o), "layer %d", l)
		}
	}

	g2 := newGroupedG1(t)
	plain := &recCopier{e: g2.e}
	w2 := newWorker(t, g2, Options{HostBlocks: 4, MaxConcurrent: 1, BatchSize: 4, G1: plain})
	_, failed = run(t, w2, &plan.Step{Seq: 1, G1Groups: rows(2, row),
		Saves: copies(plan.G1, []int64{3}, plan.G2, []int64{0})})
	require.Empty(t, failed)
	_, failed = run(t, w2, &plan.Step{Seq: 2, G1Groups: rows(2, load),
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0}, plan.G1, []int64{20})}}})
	require.Equal(t, []int64{20}, failed)
	require.Empty(t, plain.gathered)
	require.Empty(t, plain.scatter)
}
