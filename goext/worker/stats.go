package worker

import (
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/policy"
)

// DirectionStats are one transfer direction's totals on this worker
// (monotonic, since the worker was created).
type DirectionStats struct {
	Blocks  uint64  `json:"blocks"`  // blocks copied successfully
	Failed  uint64  `json:"failed"`  // block copies that failed
	Bytes   uint64  `json:"bytes"`   // bytes of the blocks copied (this rank's share)
	Seconds float64 `json:"seconds"` // time spent in the batches, summed
	Batches uint64  `json:"batches"` // batches timed
}

// transferStats keeps this worker's DirectionStats. The Prometheus set the
// worker records into is shared by every worker of the process, so the
// per-worker totals the engine's own metrics read (TransferStats) are kept
// here as well.
type transferStats struct {
	mu   sync.Mutex
	dirs map[string]DirectionStats
	// timings: the last timed load batches (at most maxTimings), for a
	// leader in another process (TakeTransferTimings).
	timings []policy.Timing
	// seq counts the batches recorded; TransferSeq reads it without the
	// lock, and sink (PublishTransferSeq) receives every new value.
	seq  atomic.Uint64
	sink atomic.Pointer[atomic.Int64]
}

// maxTimings bounds the timed batches kept between two
// TakeTransferTimings (the oldest go first).
const maxTimings = 256

// record adds one batch (timed when timed is true) of direction dir.
func (s *transferStats) record(dir string, blocks, failed int, bytes int64, secs float64, timed bool) {
	if timed && bytes > 0 {
		// The load-cost model of a leader in this process (goext/policy).
		policy.ReportTransfer(dir, bytes, time.Duration(secs*float64(time.Second)))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dirs == nil {
		s.dirs = make(map[string]DirectionStats)
	}
	if timed && bytes > 0 && policy.IsLoad(dir) {
		if len(s.timings) >= maxTimings {
			s.timings = append(s.timings[:0], s.timings[1:]...)
		}
		s.timings = append(s.timings, policy.Timing{Dir: dir, Bytes: bytes, Seconds: secs})
	}
	d := s.dirs[dir]
	d.Blocks += uint64(blocks)
	d.Failed += uint64(failed)
	d.Bytes += uint64(max(bytes, 0))
	if timed {
		d.Seconds += secs
		d.Batches++
	}
	s.dirs[dir] = d
	n := s.seq.Add(1)
	if p := s.sink.Load(); p != nil {
		p.Store(int64(n))
	}
}

// TakeTransferTimings returns the load batches this worker timed since the
// last call (at most the last 256), for the load-cost model of a leader in
// another process (a leader in this one hears them directly). Only rank 0's
// are returned (every rank moves its shard of the same blocks in the same
// step: one rank's timings measure the load); the others' are dropped.
func (w *Worker) TakeTransferTimings() []policy.Timing {
	w.xfer.mu.Lock()
	defer w.xfer.mu.Unlock()
	out := w.xfer.timings
	w.xfer.timings = nil
	if w.opts.Rank != 0 {
		return nil
	}
	return out
}

// TransferSeq counts the batches recorded into TransferStats so far: a
// caller that reports the totals' changes (the engine's per-step connector
// stats) reads TransferStats only when it moved. Cheap: one atomic load.
func (w *Worker) TransferSeq() uint64 {
	return w.xfer.seq.Load()
}

// PublishTransferSeq keeps *to equal to TransferSeq from now on (the C
// ABI's figure slots, which the engine reads without a call).
func (w *Worker) PublishTransferSeq(to *atomic.Int64) {
	w.xfer.mu.Lock()
	defer w.xfer.mu.Unlock()
	w.xfer.sink.Store(to)
	to.Store(int64(w.xfer.seq.Load()))
}

// TransferStats returns this worker's totals per direction ("g1_to_g2",
// "g2_to_g1", "g2_to_g3", "g3_to_g1", "g1_to_g3", "g4_to_g2", "g2_to_g4").
func (w *Worker) TransferStats() map[string]DirectionStats {
	w.xfer.mu.Lock()
	defer w.xfer.mu.Unlock()
	return maps.Clone(w.xfer.dirs)
}
