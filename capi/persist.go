package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/node"
)

// The persistent disk tier's hand-over between processes
// (docs/persistent-g3.md; goext/node persist.go for the one in-process).

// kvbm_worker_recovered returns this worker's recovered index (msgpack, for
// kvbm_leader_restore_disk); empty without a persistent disk tier.
//
//export kvbm_worker_recovered
func kvbm_worker_recovered(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_recovered", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	cBuffer(h.Recovered, out, outLen)
	return statusOK
}

// kvbm_leader_restore_disk registers the G3 blocks every rank recovered:
// buf is a msgpack array of kvbm_worker_recovered results, rank 0 first.
// It must come before the first step; *registered is how many blocks.
//
//export kvbm_leader_restore_disk
func kvbm_leader_restore_disk(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, registered *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkIn("kvbm_leader_restore_disk", "recovered-index buffer", buf, n),
		checkOut("kvbm_leader_restore_disk", ptr(registered))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	// The input comes from the engine's own adapter (what its workers
	// returned), not from the network.
	b := goBytes(buf, n)
	var raw [][]byte
	if err := msgpack.Unmarshal(b, &raw); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_restore_disk: %v", err), errOut)
	}
	ranks := make([]node.RecoveredRank, len(raw))
	for i, r := range raw {
		if err := msgpack.Unmarshal(r, &ranks[i]); err != nil {
			return finish(errorf(statusInvalid, "kvbm_leader_restore_disk: rank %d: %v", i, err), errOut)
		}
	}
	got, err := h.n.RestoreDisk(ranks)
	if err != nil {
		return finish(errorf(statusState, "kvbm_leader_restore_disk: %v", err), errOut)
	}
	*registered = C.int64_t(got)
	return statusOK
}
