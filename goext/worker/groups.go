package worker

import (
	"errors"
	"fmt"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/transfer"
)

// KV cache groups (layout/groups.go): a G1 block in a plan is the primary
// group's block at one token position, and the step's plan.GroupRows name
// every group's block there. A step may carry rows for an engine with one
// group too (a sliding-window model's only group): its copies then follow
// the rows, so a position whose block vLLM replaced with its null block is
// neither loaded into nor saved from.

// ErrNoGroupRow is wrapped by the error of a G1 copy on an engine with
// several KV cache groups whose block the step's group rows do not name.
var ErrNoGroupRow = errors.New("worker: G1 block has no KV cache group row in this step's plan")

// g1Row returns the row of G1 block b: each group's block at b's position.
// A save (read) needs every group's block, since a stored block holds every
// layer; a load leaves the layers of a group without a block unwritten.
//
// errprefix: its errors are the copy's, which Run's error wraps.
func (w *Worker) g1Row(rows map[int64][]int64, b int64, read bool) ([]int64, error) {
	row, ok := rows[b]
	if !ok {
		return nil, fmt.Errorf("G1 block %d: %w", b, ErrNoGroupRow) // errprefix: ErrNoGroupRow carries it
	}
	if len(row) != w.g1.NumGroups() {
		return nil, fmt.Errorf("G1 block %d: group row %v has %d entries, the engine has %d KV cache groups",
			b, row, len(row), w.g1.NumGroups())
	}
	for g, blk := range row {
		if blk == layout.NoBlock && (!read || w.g1.StateGroup(g)) {
			continue // a state group holds a state at some positions only
		}
		if blk == layout.NoBlock {
			return nil, fmt.Errorf("G1 block %d: KV cache group %d holds no block at its position, "+
				"and a stored block must hold every layer", b, g)
		}
		if blk < 0 || blk >= int64(w.g1.NumBlocks) {
			return nil, fmt.Errorf("G1 block %d: group %d's block %d out of range [0, %d)", b, g, blk, w.g1.NumBlocks)
		}
	}
	return row, nil
}

func (w *Worker) gatherRows(rows [][]int64, dsts [][]byte) error {
	if w.g1.NumGroups() == 1 { // g1Row let no NoBlock through for a read
		return w.gather(oneGroup(rows, dsts))
	}
	if w.opts.G1 != nil {
		rc, ok := w.opts.G1.(G1RowCopier)
		if !ok {
			return fmt.Errorf("worker: %d KV cache groups: %w", w.g1.NumGroups(), errGroupsCopier)
		}
		return rc.GatherRows(rows, dsts)
	}
	transfer.GatherRows(w.g1, rows, dsts)
	return nil
}

func (w *Worker) scatterRows(rows [][]int64, srcs [][]byte) error {
	if w.g1.NumGroups() == 1 {
		return w.scatter(oneGroup(rows, srcs))
	}
	if w.opts.G1 != nil {
		rc, ok := w.opts.G1.(G1RowCopier)
		if !ok {
			return fmt.Errorf("worker: %d KV cache groups: %w", w.g1.NumGroups(), errGroupsCopier)
		}
		return rc.ScatterRows(rows, srcs)
	}
	transfer.ScatterRows(w.g1, rows, srcs)
	return nil
}

// errGroupsCopier: a G1 copier that is not a G1RowCopier moves whole blocks
// of one block table (node refuses it with several groups at start).
var errGroupsCopier = errors.New("the G1 copier does not copy per KV cache group") // errprefix: wrapped by the worker: errors above

// invalidate marks a G2 or G3 destination as holding no completed write.
func (w *Worker) invalidate(t plan.Tier, b int64) {
	switch t {
	case plan.G2:
		w.hostValid[b].Store(false)
	case plan.G3:
		w.diskValid[b].Store(false)
	}
}

// oneGroup turns rows of a one-group engine into whole-block copies for any
// copier (the CUDA one included): a position without a block is dropped.
func oneGroup(rows [][]int64, bufs [][]byte) ([]int, [][]byte, [][]int64) {
	blocks := make([]int, 0, len(rows))
	kept := make([][]byte, 0, len(rows))
	for i, r := range rows {
		if r[0] != layout.NoBlock {
			blocks, kept = append(blocks, int(r[0])), append(kept, bufs[i])
		}
	}
	return blocks, kept, nil
}
