package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"fmt"
	"os"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/policy"
)

// kvbm_leader_set_g4_fingerprint gives the leader rank 0's block
// fingerprint (32 hex digits, as kvbm_worker_info reports it): its G4
// lookups start. A leader that already has it, or has no G4 tier, ignores it.
//
//export kvbm_leader_set_g4_fingerprint
func kvbm_leader_set_g4_fingerprint(hd C.uint64_t, fpHex *C.char, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	fp, err := fingerprint.Parse(C.GoString(fpHex))
	if err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_set_g4_fingerprint: %v", err), errOut)
	}
	return finish(h.setG4Fingerprint(fp), errOut)
}

// setG4Fingerprint opens rank 0's store for the leader (node.Leader.SetG4Fingerprint).
func (h *leaderHandle) setG4Fingerprint(fp fingerprint.Fingerprint) error {
	return h.n.SetG4Fingerprint(fp)
}

// g4Report is what a worker tells its leader, when they may live in
// different processes: the hashes it stored since the last report and its
// process's G4 counters.
type g4Report struct {
	Pid    int          `msgpack:"pid"`
	Acked  []uint64     `msgpack:"acked"`
	Stats  object.Stats `msgpack:"stats"`
	Source string       `msgpack:"source"`
}

// kvbm_worker_g4_report returns a msgpack g4Report (empty without a G4 tier).
//
//export kvbm_worker_g4_report
func kvbm_worker_g4_report(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_g4_report", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	*out, *outLen = nil, 0
	if h.G4 == nil {
		return statusOK
	}
	b, err := msgpack.Marshal(g4Report{Pid: os.Getpid(), Acked: h.G4.TakeAcked(), Stats: object.Local(),
		Source: fmt.Sprintf("pid-%d", os.Getpid())})
	if err != nil {
		return finish(fmt.Errorf("encode G4 report: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_leader_g4_report takes a worker's report: its stored hashes join the
// leader's registry, and the counters of a worker in another process are
// served on this process's metrics endpoint.
//
//export kvbm_leader_g4_report
func kvbm_leader_g4_report(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn("kvbm_leader_g4_report", "report buffer", buf, n); err != nil {
		return finish(err, errOut)
	}
	var r g4Report
	if err := msgpack.Unmarshal(goBytes(buf, n), &r); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_g4_report: %v", err), errOut)
	}
	h.l.G4Stored(r.Acked)
	if r.Pid != os.Getpid() && r.Source != "" {
		object.SetRemote(r.Source, r.Stats)
	}
	return statusOK
}

// transferTimings is what a worker tells its leader of its timed load
// batches, when they may live in different processes.
type transferTimings struct {
	Pid     int             `msgpack:"pid"`
	Timings []policy.Timing `msgpack:"timings"`
}

// kvbm_worker_transfer_timings returns a msgpack transferTimings of the
// load batches rank 0's worker timed since the last call (empty when there
// are none, and on other ranks).
//
//export kvbm_worker_transfer_timings
func kvbm_worker_transfer_timings(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_transfer_timings", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	*out, *outLen = nil, 0
	ts := h.W.TakeTransferTimings()
	if len(ts) == 0 {
		return statusOK
	}
	b, err := msgpack.Marshal(transferTimings{Pid: os.Getpid(), Timings: ts})
	if err != nil {
		return finish(fmt.Errorf("encode transfer timings: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_leader_transfer_timings feeds a worker's timed load batches to the
// leader's load-cost model; those of a worker in this process are ignored
// (the model hears them directly, goext/policy's transfer hub).
//
//export kvbm_leader_transfer_timings
func kvbm_leader_transfer_timings(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn("kvbm_leader_transfer_timings", "timings buffer", buf, n); err != nil {
		return finish(err, errOut)
	}
	var r transferTimings
	if err := msgpack.Unmarshal(goBytes(buf, n), &r); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_transfer_timings: %v", err), errOut)
	}
	if r.Pid != os.Getpid() {
		h.l.CostModel().ObserveTimings(r.Timings)
	}
	return statusOK
}
