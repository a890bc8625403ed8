package worker

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
)

// G4 (object storage, package object): downloads are a load's staging copies
// G4 → G2 (into a bounce block the leader allocated), run before the G2 → G1
// copies of the same step; uploads are queued right after the step's Saves.
// Neither ever blocks an engine step on the network beyond a load's own
// (asynchronous) completion: uploads only copy the block into the store's
// bounded queue, which drops instead of waiting.

// g4Downloads bounds the downloads of one load batch in flight.
const g4Downloads = object.DownloadsInFlight

// runDownloads executes G4 → G2 copies; errs[i] is ops[i]'s result. A
// block that fails (missing, unreachable store, does not verify) leaves its
// G2 block invalid, so the G2 → G1 copy that follows fails and the engine
// recomputes the block.
//
// errprefix: its errors are the copies', logged by execLoads, never returned.
func (w *Worker) runDownloads(ops []plan.Copy, saltOf func(uint64) uint64) []error {
	errs := make([]error, len(ops))
	if len(ops) == 0 {
		return errs
	}
	start := time.Now()
	sem := make(chan struct{}, g4Downloads)
	var wg sync.WaitGroup
	for i, c := range ops {
		if w.opts.G4 == nil {
			errs[i] = fmt.Errorf("G4: %w", ErrNoTier)
			continue
		}
		if c.Dst != plan.G2 {
			errs[i] = fmt.Errorf("unsupported copy G4 → %v", c.Dst)
			continue
		}
		if err := w.checkBlock(plan.G2, c.DstBlock); err != nil {
			errs[i] = fmt.Errorf("copy destination: %w", err)
			continue
		}
		w.hostValid[c.DstBlock].Store(false)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			dst := int(c.DstBlock)
			if err := w.opts.G4.DownloadSalted(context.Background(), saltOf(uint64(c.SrcBlock)), uint64(c.SrcBlock), w.host.Block(dst)); err != nil {
				errs[i] = err
				return
			}
			w.hostValid[dst].Store(true)
		}()
	}
	wg.Wait()
	var moved int64
	ok := 0
	for _, e := range errs {
		if e == nil {
			moved += w.bpb
			ok++
		}
	}
	secs := time.Since(start).Seconds()
	w.xfer.record("g4_to_g2", ok, len(errs)-ok, moved, secs, true)
	w.m.TransferSecs.WithLabelValues("g4_to_g2").Observe(secs)
	if moved > 0 {
		w.m.BytesMoved.WithLabelValues("g4_to_g2").Add(float64(moved))
	}
	return errs
}

// splitDownloads separates G4 → G2 copies from the other staging copies.
func splitDownloads(staging []plan.Copy) (g4, rest []plan.Copy) {
	for _, c := range staging {
		if c.Src == plan.G4 {
			g4 = append(g4, c)
		} else {
			rest = append(rest, c)
		}
	}
	return g4, rest
}

// queueUploads hands the step's G2 → G4 uploads to the store's queue. A
// block whose save did not complete is not uploaded; a full queue or an
// unavailable store drops the upload (counted by the store).
func (w *Worker) queueUploads(ups []plan.Upload, saltOf func(uint64) uint64) {
	if len(ups) == 0 || w.opts.G4 == nil {
		return
	}
	var moved int64
	for _, u := range ups {
		if err := w.checkBlock(plan.G2, u.Block); err != nil {
			w.log.Warn("kvbm worker: ignoring upload of an unknown block", "block", u.Block, "err", err)
			continue
		}
		if !w.hostValid[u.Block].Load() {
			continue
		}
		if w.opts.G4.EnqueueSalted(saltOf(u.Hash), u.Hash, u.Parent, w.host.Block(int(u.Block))) {
			moved += w.bpb
		}
	}
	if moved > 0 {
		// Queued uploads: the store's own counters say how they ended.
		w.xfer.record("g2_to_g4", int(moved/max(w.bpb, 1)), 0, moved, 0, false)
		w.m.BytesMoved.WithLabelValues("g2_to_g4").Add(float64(moved))
	}
}
