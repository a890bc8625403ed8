package main

/*
#include <stdlib.h>
#include "kvbm.h"
*/
import "C"

import (
	"sync/atomic"
	"unsafe"

	"github.com/kvbm/kvbm/goext/object"
)

// Figures an engine reads every step, kept by Go in a few words of C memory
// that the caller reads at their address (kvbm_leader_figures_addr,
// kvbm_worker_figures_addr) instead of through a call. A call into Go from
// an engine thread that ran the model for milliseconds costs tens of
// microseconds (the callback takes a P and wakes the runtime's monitor),
// several times per step; a load from memory costs nothing.
//
// Each word is written with an atomic store; readers load whole aligned
// words. The memory is never freed: a reader that races the handle's free
// reads a stale figure, never freed memory (a few dozen bytes per handle).

// figureSlots is one handle's words.
type figureSlots struct {
	p unsafe.Pointer
	n int
}

func newFigureSlots(n int) figureSlots {
	p := C.calloc(C.size_t(n), 8)
	if p == nil {
		panic("kvbm: calloc of the figure slots failed")
	}
	return figureSlots{p: p, n: n}
}

func (f figureSlots) word(i int) *atomic.Int64 {
	if i < 0 || i >= f.n {
		panic("kvbm: figure slot out of range")
	}
	return (*atomic.Int64)(unsafe.Add(f.p, 8*i))
}

// Leader figure slots (python/kvbm/_core.py LEADER_FIGURES reads them in
// this order): a count of publications (0: none yet), then the figures of
// kvbm_leader_info the engine's per-step connector stats report.
const (
	figPublished = iota
	figHostBlocksUsed
	figDiskBlocksUsed
	figDegraded
	figG4
	figG4QueueDepth
	figG4BreakersOpen
	figG4LookupHits
	figG4LookupMisses
	figStepNeeded // 1 while the leader waits for a step (leader.StepNeeded); kept current by the leader itself
	leaderFigureSlots
)

// publishFigures stores the leader's current figures in its slots; after
// every step and every kvbm_leader_info.
func (h *leaderHandle) publishFigures() {
	if h.l == nil || h.figs.p == nil {
		return
	}
	f := h.figs
	hostUsed, diskUsed := h.l.BlocksUsed()
	degraded, _ := h.l.Degraded()
	f.word(figHostBlocksUsed).Store(int64(hostUsed))
	f.word(figDiskBlocksUsed).Store(int64(diskUsed))
	f.word(figDegraded).Store(b2i(degraded))
	if h.l.G4Enabled() {
		s := object.Snapshot()
		f.word(figG4).Store(1)
		f.word(figG4QueueDepth).Store(int64(s.QueueDepth))
		f.word(figG4BreakersOpen).Store(int64(s.BreakersOpen))
		f.word(figG4LookupHits).Store(int64(s.LookupHits))
		f.word(figG4LookupMisses).Store(int64(s.LookupMisses))
	}
	f.word(figPublished).Add(1)
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// kvbm_leader_figures_addr sets *out to the address of the leader's figure
// slots (int64 words, see leaderFigureSlots) and *out_n to their count.
//
//export kvbm_leader_figures_addr
func kvbm_leader_figures_addr(hd C.uint64_t, out *C.uint64_t, outN *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := checkOut("kvbm_leader_figures_addr", ptr(out), ptr(outN)); err != nil {
		return finish(err, errOut)
	}
	h, done, err := acquire[*leaderHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	*out, *outN = C.uint64_t(uintptr(h.figs.p)), C.int64_t(h.figs.n)
	return statusOK
}

// Worker figure slots: the count of transfer batches recorded
// (worker.TransferSeq); kvbm_worker_stats changes only when it does.
const (
	figTransferSeq = iota
	workerFigureSlots
)

// kvbm_worker_figures_addr sets *out to the address of the worker's figure
// slots (int64 words, see workerFigureSlots) and *out_n to their count.
//
//export kvbm_worker_figures_addr
func kvbm_worker_figures_addr(hd C.uint64_t, out *C.uint64_t, outN *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := checkOut("kvbm_worker_figures_addr", ptr(out), ptr(outN)); err != nil {
		return finish(err, errOut)
	}
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	*out, *outN = C.uint64_t(uintptr(h.figs.p)), C.int64_t(h.figs.n)
	return statusOK
}
