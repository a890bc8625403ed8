package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"unsafe"
)

//export kvbm_leader_match
func kvbm_leader_match(hd C.uint64_t, reqID *C.char, tokens *C.uint32_t, n C.int64_t, salt C.uint64_t,
	numComputed C.int64_t, outTokens *C.int64_t, outAsync *C.int32_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if numComputed < 0 {
		return finish(errorf(statusInvalid, "kvbm_leader_match: negative length: num_computed=%d", int64(numComputed)), errOut)
	}
	if err := errors.Join(checkReqID("kvbm_leader_match", reqID),
		checkIn("kvbm_leader_match", "token array", unsafe.Pointer(tokens), n),
		checkOut("kvbm_leader_match", ptr(outTokens), ptr(outAsync))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	got, async := h.l.GetNumNewMatchedTokens(C.GoString(reqID), tokensView(tokens, n), uint64(salt), int(numComputed))
	*outTokens = C.int64_t(got)
	*outAsync = 0
	if async {
		*outAsync = 1
	}
	return statusOK
}

func int64View(p *C.int64_t, n C.int64_t) []int64 {
	if p == nil || n <= 0 {
		return nil
	}
	return unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n))
}

//export kvbm_leader_update_after_alloc
func kvbm_leader_update_after_alloc(hd C.uint64_t, reqID *C.char, blockIDs *C.int64_t, n C.int64_t,
	numExternal C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkReqID("kvbm_leader_update_after_alloc", reqID),
		checkIn("kvbm_leader_update_after_alloc", "block id array", unsafe.Pointer(blockIDs), n)); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	if numExternal < 0 {
		return finish(errorf(statusInvalid, "kvbm_leader_update_after_alloc: negative external token count %d", int64(numExternal)), errOut)
	}
	ids := append([]int64(nil), int64View(blockIDs, n)...)
	h.l.UpdateStateAfterAlloc(C.GoString(reqID), ids, int(numExternal))
	return statusOK
}

// kvbm_leader_load_sources splits the first num_tokens tokens of a planned
// load (after kvbm_leader_update_after_alloc, before the next step) by the
// tier they come from: host (G2), disk (G3) and remote (G4) tokens, in block
// order. vLLM asks for it to report cache hits per source.
//
//export kvbm_leader_load_sources
func kvbm_leader_load_sources(hd C.uint64_t, reqID *C.char, numTokens C.int64_t, outHost, outDisk, outRemote *C.int64_t,
	errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkReqID("kvbm_leader_load_sources", reqID),
		checkOut("kvbm_leader_load_sources", ptr(outHost), ptr(outDisk), ptr(outRemote))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	if numTokens < 0 {
		return finish(errorf(statusInvalid, "kvbm_leader_load_sources: negative token count %d", int64(numTokens)), errOut)
	}
	host, disk, remote := h.l.LoadSources(C.GoString(reqID), int(numTokens))
	*outHost, *outDisk, *outRemote = C.int64_t(host), C.int64_t(disk), C.int64_t(remote)
	return statusOK
}

//export kvbm_leader_request_finished
func kvbm_leader_request_finished(hd C.uint64_t, reqID *C.char, outPending *C.int32_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkReqID("kvbm_leader_request_finished", reqID),
		checkOut("kvbm_leader_request_finished", ptr(outPending))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	*outPending = 0
	if h.l.RequestFinished(C.GoString(reqID)) {
		*outPending = 1
	}
	return statusOK
}

//export kvbm_leader_reset
func kvbm_leader_reset(hd C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	h.l.ResetCache()
	return statusOK
}
