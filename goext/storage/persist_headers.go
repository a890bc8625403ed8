package storage

import (
	"log/slog"
	"sync"
	"sync/atomic"
)

// headerWriter writes block headers in the background. A header is a
// 4 KiB write whose latency, paid inline, cost about 10% of G3 write
// throughput (bench/g3persist); queued, it overlaps the next payloads.
//
// Ordering: a header is queued only after its payload's write returned,
// and a slot's next write (or invalidation) first waits until the slot
// has no header write queued or running, so a header never lands after
// the bytes it describes were replaced. A header still queued when the
// process dies is simply missing: that block is not recovered.
type headerWriter struct {
	d    *DiskRegion
	jobs chan headerJob
	log  *slog.Logger
	wg   sync.WaitGroup

	pending []atomic.Bool // slot has a header write queued or running
	failed  atomic.Bool

	// mu guards no field: with done it waits for a slot's pending flag to
	// clear (the writer broadcasts after clearing it).
	mu   sync.Mutex
	done *sync.Cond // on mu

	sendMu sync.RWMutex // guards closed: senders (read) against close (write)
	closed bool
}

type headerJob struct {
	i   int
	buf *[]byte // from headerBufs
}

// headerWriters is how many header writes run at once.
const headerWriters = 4

func newHeaderWriter(d *DiskRegion, log *slog.Logger) *headerWriter {
	hw := &headerWriter{d: d, pending: make([]atomic.Bool, d.numBlocks), jobs: make(chan headerJob, 256), log: log}
	hw.done = sync.NewCond(&hw.mu)
	for range headerWriters {
		hw.wg.Add(1)
		go hw.run() // joined by close
	}
	return hw
}

func (hw *headerWriter) run() {
	defer hw.wg.Done()
	for j := range hw.jobs {
		err := hw.d.writeHeader(j.i, *j.buf)
		headerBufs.Put(j.buf)
		if err == nil {
			hw.d.live[j.i].Store(true)
		} else if hw.failed.CompareAndSwap(false, true) {
			hw.log.Warn("kvbm disk tier: a block header could not be written; such blocks are not recovered at "+
				"the next start", "path", hw.d.path, "err", err)
		}
		hw.mu.Lock()
		hw.pending[j.i].Store(false)
		hw.done.Broadcast()
		hw.mu.Unlock()
	}
}

// wait returns once slot i has no header write queued or running.
func (hw *headerWriter) wait(i int) {
	if !hw.pending[i].Load() {
		return
	}
	hw.mu.Lock()
	for hw.pending[i].Load() {
		hw.done.Wait()
	}
	hw.mu.Unlock()
}

// enqueue queues buf as slot i's header; false once closed (the caller
// writes it itself).
func (hw *headerWriter) enqueue(i int, buf *[]byte) bool {
	hw.sendMu.RLock()
	defer hw.sendMu.RUnlock()
	if hw.closed {
		return false
	}
	hw.pending[i].Store(true)
	hw.jobs <- headerJob{i: i, buf: buf}
	return true
}

// close writes what is queued and stops the writers.
func (hw *headerWriter) close() {
	hw.sendMu.Lock()
	if !hw.closed {
		hw.closed = true
		close(hw.jobs)
	}
	hw.sendMu.Unlock()
	hw.wg.Wait()
}
