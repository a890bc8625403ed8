package worker

// Executing copies: batching, the limiters, memory and disk copies of one
// block, and failure logging.

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/transfer"
)

// fence orders the G1 copier after the engine's submitted work. A failure
// is logged; the copies still run (their own errors are reported per block).
func (w *Worker) fence(what string) {
	if w.opts.G1 == nil {
		return
	}
	if err := w.opts.G1.Fence(); err != nil {
		w.log.Warn("kvbm worker: could not order "+what+" copies after the engine's work", "err", err)
	}
}

func countErrs(errs []error) int {
	n := 0
	for _, e := range errs {
		if e != nil {
			n++
		}
	}
	return n
}

// logFailures writes one line per phase, not one per block: a dead disk
// would otherwise flood the engine's log.
func (w *Worker) logFailures(what string, ops []plan.Copy, errs []error) {
	var first error
	var firstOp plan.Copy
	for i, e := range errs {
		if e != nil {
			first, firstOp = e, ops[i]
			break
		}
	}
	w.log.Warn("kvbm worker: "+what+" copies failed", "failed", countErrs(errs), "of", len(ops),
		"first", fmt.Sprintf("%v[%d]→%v[%d]", firstOp.Src, firstOp.SrcBlock, firstOp.Dst, firstOp.DstBlock), "err", first)
}

// direction names a copy's direction for the metrics label.
func direction(c plan.Copy) string {
	return strings.ToLower(c.Src.String() + "_to_" + c.Dst.String())
}

// runOps executes ops in batches of at most BatchSize blocks, each batch one
// direction, with at most MaxConcurrent batches in flight. errs[i] is op i's result.
//
// rows maps the G1 blocks of ops to every KV cache group's block at their
// position (plan.GroupRows); nil for an engine with one group.
func (w *Worker) runOps(ops []plan.Copy, rows map[int64][]int64) []error {
	errs := make([]error, len(ops))
	if len(ops) == 0 {
		return errs
	}
	order := make([]int, len(ops))
	for i := range order {
		order[i] = i
	}
	key := func(c plan.Copy) int { return int(c.Src)*16 + int(c.Dst) }
	// Within one direction, order by the block whose placement matters:
	// the G1 block (neighbouring engine memory, see transfer.GatherBlocks),
	// else the disk block (sequential file offsets).
	locality := func(c plan.Copy) int64 {
		switch {
		case c.Src == plan.G1:
			return c.SrcBlock
		case c.Dst == plan.G1, c.Dst == plan.G3:
			return c.DstBlock
		}
		return c.SrcBlock
	}
	slices.SortStableFunc(order, func(a, b int) int {
		if d := key(ops[a]) - key(ops[b]); d != 0 {
			return d
		}
		return cmp.Compare(locality(ops[a]), locality(ops[b]))
	})
	type batch struct{ lo, hi int } // range of order
	var batches []batch
	for lo := 0; lo < len(order); {
		hi := lo + 1
		limit := w.batchLimit(ops[order[lo]])
		for hi < len(order) && hi-lo < limit && key(ops[order[hi]]) == key(ops[order[lo]]) {
			hi++
		}
		batches = append(batches, batch{lo, hi})
		lo = hi
	}
	// Memory batches and disk batches run under their own limits, side by side.
	var memB, diskB []batch
	for _, b := range batches {
		if c := ops[order[b.lo]]; c.Src == plan.G3 || c.Dst == plan.G3 {
			diskB = append(diskB, b)
		} else {
			memB = append(memB, b)
		}
	}
	run := func(bs []batch) func(slot, bi, _ int) {
		return func(slot, bi, _ int) {
			b := bs[bi]
			dir := direction(ops[order[b.lo]])
			start := time.Now()
			var moved int64
			idx := order[b.lo:b.hi]
			if c := ops[idx[0]]; (c.Src == plan.G1 && c.Dst == plan.G2) || (c.Src == plan.G2 && c.Dst == plan.G1) {
				w.copyMemBatch(ops, idx, errs, rows)
			} else {
				for _, i := range idx {
					errs[i] = w.copyOne(ops[i], slot, rows)
				}
			}
			ok := 0
			for _, i := range idx {
				if errs[i] == nil {
					moved += w.bpb
					ok++
				}
			}
			secs := time.Since(start).Seconds()
			w.xfer.record(dir, ok, len(idx)-ok, moved, secs, true)
			w.m.TransferSecs.WithLabelValues(dir).Observe(secs)
			if moved > 0 {
				w.m.BytesMoved.WithLabelValues(dir).Add(float64(moved))
			}
		}
	}
	var wg sync.WaitGroup
	if len(diskB) > 0 {
		wg.Add(1)
		go func() { // joined below, before runOps returns
			defer wg.Done()
			w.diskLim.Run(len(diskB), 1, run(diskB))
		}()
	}
	w.lim.Run(len(memB), 1, run(memB))
	wg.Wait()
	return errs
}

// batchLimit is the most blocks one batch of c's direction carries.
func (w *Worker) batchLimit(c plan.Copy) int {
	if c.Src == plan.G1 || c.Dst == plan.G1 {
		if g := w.opts.G1; g != nil && g.MaxBatch() > 0 {
			return g.MaxBatch()
		}
	}
	return w.opts.BatchSize
}

// gather and scatter move one set of G1 blocks through the configured copier;
// with KV cache groups, grp[i] is blocks[i]'s row (groups.go).
func (w *Worker) gather(blocks []int, dsts [][]byte, grp [][]int64) error {
	if grp != nil {
		return w.gatherRows(grp, dsts)
	}
	if w.opts.G1 != nil {
		return w.opts.G1.GatherBlocks(blocks, dsts)
	}
	transfer.GatherBlocks(w.g1, blocks, dsts)
	return nil
}

func (w *Worker) scatter(blocks []int, srcs [][]byte, grp [][]int64) error {
	if grp != nil {
		return w.scatterRows(grp, srcs)
	}
	if w.opts.G1 != nil {
		return w.opts.G1.ScatterBlocks(blocks, srcs)
	}
	transfer.ScatterBlocks(w.g1, blocks, srcs)
	return nil
}

// checkBlock reports a block outside tier t.
//
// errprefix: its errors are the copy's, which Run's error wraps.
func (w *Worker) checkBlock(t plan.Tier, b int64) error {
	var n int
	switch t {
	case plan.G1:
		n = w.g1.NumBlocks
	case plan.G2:
		if w.host == nil {
			return fmt.Errorf("%v: %w", t, ErrNoTier)
		}
		n = w.host.NumBlocks()
	case plan.G3:
		if w.disk == nil {
			return fmt.Errorf("%v: %w", t, ErrNoTier)
		}
		n = len(w.diskValid)
	default:
		return fmt.Errorf("unknown tier %v", t)
	}
	if b < 0 || b >= int64(n) {
		return fmt.Errorf("%v block %d out of range [0, %d)", t, b, n)
	}
	return nil
}

// copyMemBatch runs one batch of G1→G2 or G2→G1 copies as a single chunk
// walk over all its blocks (transfer.GatherBlocks / ScatterBlocks).
//
// errprefix: its errors are the copies', which Run's error wraps.
func (w *Worker) copyMemBatch(ops []plan.Copy, idx []int, errs []error, rows map[int64][]int64) {
	toHost := ops[idx[0]].Src == plan.G1
	var grp [][]int64
	g1s := make([]int, 0, len(idx))
	bufs := make([][]byte, 0, len(idx))
	live := make([]int, 0, len(idx))
	for _, i := range idx {
		c := ops[i]
		if err := w.checkBlock(c.Src, c.SrcBlock); err != nil {
			errs[i] = fmt.Errorf("copy source: %w", err)
			continue
		}
		if err := w.checkBlock(c.Dst, c.DstBlock); err != nil {
			errs[i] = fmt.Errorf("copy destination: %w", err)
			continue
		}
		if toHost {
			// Invalid until written, whether or not the write can run.
			w.hostValid[c.DstBlock].Store(false)
		}
		if rows != nil || w.g1.NumGroups() > 1 {
			g1 := c.DstBlock
			if toHost {
				g1 = c.SrcBlock
			}
			row, err := w.g1Row(rows, g1, toHost)
			if err != nil {
				errs[i] = err
				continue
			}
			grp = append(grp, row)
		}
		if toHost {
			g1s, bufs = append(g1s, int(c.SrcBlock)), append(bufs, w.host.Block(int(c.DstBlock)))
		} else {
			if !w.hostValid[c.SrcBlock].Load() {
				errs[i] = fmt.Errorf("G2 block %d: %w", c.SrcBlock, ErrNotValid)
				continue
			}
			g1s, bufs = append(g1s, int(c.DstBlock)), append(bufs, w.host.Block(int(c.SrcBlock)))
		}
		live = append(live, i)
	}
	defer func() {
		if r := recover(); r != nil {
			err := fmt.Errorf("internal error in a batch of %d copies: %v", len(live), r)
			w.log.Error("kvbm worker: recovered from a panic in a copy batch", "err", err)
			for _, i := range live {
				errs[i] = err
			}
		}
	}()
	if toHost {
		if err := w.gather(g1s, bufs, grp); err != nil {
			for _, i := range live {
				errs[i] = err
			}
			return
		}
		for _, i := range live {
			w.hostValid[ops[i].DstBlock].Store(true)
		}
	} else if err := w.scatter(g1s, bufs, grp); err != nil {
		for _, i := range live {
			errs[i] = err
		}
	}
}

// copyOne moves one block. slot owns bounce block `slot` for G1↔G3 copies.
// A panic (a bug, never expected) fails the copy instead of the engine process.
//
// errprefix: its errors are the copy's, which Run's error wraps.
func (w *Worker) copyOne(c plan.Copy, slot int, rows map[int64][]int64) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("internal error copying %v[%d]→%v[%d]: %v", c.Src, c.SrcBlock, c.Dst, c.DstBlock, r)
			w.log.Error("kvbm worker: recovered from a panic in a copy", "err", err)
		}
	}()
	if err := w.checkBlock(c.Src, c.SrcBlock); err != nil {
		return fmt.Errorf("copy source: %w", err)
	}
	if err := w.checkBlock(c.Dst, c.DstBlock); err != nil {
		return fmt.Errorf("copy destination: %w", err)
	}
	src, dst := int(c.SrcBlock), int(c.DstBlock)
	var grp [][]int64 // with KV cache groups: the G1 side's row
	if (rows != nil || w.g1.NumGroups() > 1) && (c.Src == plan.G1 || c.Dst == plan.G1) {
		g1 := c.DstBlock
		if c.Src == plan.G1 {
			g1 = c.SrcBlock
		}
		row, err := w.g1Row(rows, g1, c.Src == plan.G1)
		if err != nil {
			w.invalidate(c.Dst, c.DstBlock) // the save cannot write it: never load its old bytes
			return err
		}
		grp = [][]int64{row}
	}
	switch {
	case c.Src == plan.G1 && c.Dst == plan.G2:
		w.hostValid[dst].Store(false)
		if err := w.gather([]int{src}, [][]byte{w.host.Block(dst)}, grp); err != nil {
			return err
		}
		w.hostValid[dst].Store(true)
		return nil

	case c.Src == plan.G2 && c.Dst == plan.G1:
		if !w.hostValid[src].Load() {
			return fmt.Errorf("G2 block %d: %w", src, ErrNotValid)
		}
		return w.scatter([]int{dst}, [][]byte{w.host.Block(src)}, grp)

	case c.Src == plan.G1 && c.Dst == plan.G3:
		buf := w.bounce.IOBlock(slot)
		if err := w.gather([]int{src}, [][]byte{buf[:w.bpb]}, grp); err != nil {
			return err
		}
		return w.writeDisk(dst, buf)

	case c.Src == plan.G2 && c.Dst == plan.G3:
		if !w.hostValid[src].Load() {
			w.diskValid[dst].Store(false)
			return fmt.Errorf("G2 block %d: %w", src, ErrNotValid)
		}
		return w.writeDisk(dst, w.host.IOBlock(src))

	case c.Src == plan.G3 && c.Dst == plan.G1:
		buf := w.bounce.IOBlock(slot)
		if err := w.readDisk(src, buf); err != nil {
			return err
		}
		return w.scatter([]int{dst}, [][]byte{buf[:w.bpb]}, grp)

	case c.Src == plan.G3 && c.Dst == plan.G2:
		w.hostValid[dst].Store(false)
		if err := w.readDisk(src, w.host.IOBlock(dst)); err != nil {
			return err
		}
		w.hostValid[dst].Store(true)
		return nil
	}
	return fmt.Errorf("unsupported copy %v → %v", c.Src, c.Dst)
}
