//go:build cuda

package cuda

import (
	"fmt"
	"syscall"
	"time"

	"gorgonia.org/cu"
)

// Split mode (DYN_KVBM_CUDA_COPY=split, and auto on CUDA ≥ 12.8): a batch
// shared between the staged pipeline and the driver's batched copies.

// runSplit, with a fixed share, enqueues the batch share first (on the
// lane's bdma streams, so the copy engines start at once) and then the
// staged share; run waits for both. Otherwise runShared shares the batch.
func (c *Copier) runSplit(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	if c.opts.SplitPercent == 0 {
		return c.runShared(l, toG1, blocks, host)
	}
	k := len(blocks) * c.opts.SplitPercent / 100
	if err := c.runBatch(l.bdma, toG1, blocks[:k], host[:k]); err != nil {
		return err
	}
	return c.runStaged(l, toG1, blocks[k:], host[k:])
}

// runShared moves the batch with no fixed share: the staged pipeline takes
// chunks from the front of the batch (in host order) whenever a staging slot
// is free, each bdma stream takes SplitChunkBytes from the back whenever it
// holds fewer than splitInFlight sub-batches, until they meet. Each side
// thus takes what it can move. The staged side also watches how long its
// gather/scatter kernels wait for SMs: while they wait (the engine's
// kernels hold the GPU), it sends one small chunk at a time, at most one per
// SplitProbe, so the engine loses little to kvbm and the copy engines move
// the rest; once
// they run at once again (an idle GPU), it fills every slot, and the batch
// crosses PCIe nearly as fast as with Staged alone. run waits for the
// queued tail.
func (c *Copier) runShared(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	st, err := c.prepareStaged(l, blocks, host)
	if err != nil {
		return err
	}
	blocks, host = st.blocks, st.host
	sub := int(max(1, c.opts.SplitChunkBytes/c.bpb))
	small := max(1, c.stagingSlots/splitBusyDiv)
	front, back, j := 0, len(blocks), 0
	type flight struct {
		j          int
		ready      time.Time // when its kernel could start, as far as we know
		dmaSeen    bool      // onboard: its DMA into the slot finished
		kernelSeen bool
	}
	var inflight []*flight
	var lastKernel time.Time
	queued := make([][]int, len(l.bdma)) // per bdma stream: bDone indices in flight, oldest first
	next := make([]int, len(l.bdma))     // per bdma stream: the bDone event to record next
	defer func() {
		c.sharedCalls.Add(1)
		c.sharedBlocks.Add(int64(len(blocks)))
		c.sharedBatch.Add(int64(len(blocks) - back))
	}()
	for front < back {
		// Retire what finished, and time the kernels.
		now := time.Now()
		for _, f := range inflight {
			s := f.j % c.depth
			if toG1 && !f.dmaSeen {
				done, err := eventDone(&l.dDone[s])
				if err != nil {
					return fmt.Errorf("cuda: staged share: %w", err)
				}
				if !done {
					break
				}
				f.dmaSeen, f.ready = true, now
			}
			if !f.kernelSeen {
				done, err := eventDone(&l.kDone[s])
				if err != nil {
					return fmt.Errorf("cuda: staged share: %w", err)
				}
				if !done {
					break
				}
				f.kernelSeen = true
				start := f.ready
				if lastKernel.After(start) {
					start = lastKernel // it queued behind the previous kernel
				}
				if wait := now.Sub(start); wait > splitBusyWait {
					l.busy = true
				} else if wait < splitIdleWait {
					l.busy = false
				}
				lastKernel = now
			}
		}
		for len(inflight) > 0 {
			f := inflight[0]
			if !f.kernelSeen {
				break
			}
			if !toG1 {
				done, err := eventDone(&l.dDone[f.j%c.depth])
				if err != nil {
					return fmt.Errorf("cuda: staged share: %w", err)
				}
				if !done {
					break
				}
			}
			inflight = inflight[1:]
		}
		for k := range queued {
			for len(queued[k]) > 0 {
				done, err := eventDone(&l.bDone[k][queued[k][0]])
				if err != nil {
					return fmt.Errorf("cuda: batch share: %w", err)
				}
				if !done {
					break
				}
				queued[k] = queued[k][1:]
			}
		}
		// Hand out more.
		progressed := false
		slots, per, streams := c.depth, c.stagingSlots, 0
		busy := l.busy
		if c.testBusy != nil {
			busy = c.testBusy(j)
		}
		if busy {
			slots, per, streams = 1, small, len(l.bdma)
			if !lastKernel.IsZero() && now.Sub(lastKernel) < c.opts.SplitProbe {
				slots = 0 // the last probe's kernel ended too recently
			}
		}
		for front < back && len(inflight) < slots {
			hi := min(front+per, back)
			if err := c.stageChunk(l, toG1, st, j, front, hi); err != nil {
				return err
			}
			inflight = append(inflight, &flight{j: j, ready: time.Now()})
			front, j, progressed = hi, j+1, true
		}
		for k := range streams {
			for front < back && len(queued[k]) < splitInFlight {
				lo := max(front, back-sub)
				if err := c.busyShare(l.bdma[k:k+1], toG1, blocks[lo:back], host[lo:back]); err != nil {
					return err
				}
				if err := l.bDone[k][next[k]].Record(l.bdma[k]); err != nil {
					return fmt.Errorf("cuda: record batched copy: %w", err)
				}
				queued[k] = append(queued[k], next[k])
				next[k], back, progressed = (next[k]+1)%splitInFlight, lo, true
			}
		}
		if !progressed && front < back {
			// Not time.Sleep: the Go runtime rounds short sleeps up to about
			// a millisecond, longer than a slot's kernel takes.
			ts := syscall.Timespec{Nsec: 20_000}
			_ = syscall.Nanosleep(&ts, nil)
		}
	}
	return nil
}

// plainWhileBusy reports whether runShared's batch share, which runs while
// the GPU is busy, goes as one plain DMA copy per block (cuMemcpyAsync, as
// Direct) instead of the driver's batched copy: for blocks that are one
// range of G1 (TensorRT-LLM), unless Options.SplitBusyBatch.
func (c *Copier) plainWhileBusy() bool {
	return c.contig && !c.opts.SplitBusyBatch && c.opts.SplitPercent == 0
}

// busyShare enqueues one chunk of runShared's batch share on s.
func (c *Copier) busyShare(s []cu.Stream, toG1 bool, blocks []int, host []uintptr) error {
	if !c.plainWhileBusy() {
		return c.runBatch(s, toG1, blocks, host)
	}
	if err := c.blockCopies(s, toG1, blocks, host); err != nil {
		return err
	}
	c.sharedPlain.Add(int64(len(blocks)))
	return nil
}
