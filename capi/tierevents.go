package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"

	"github.com/vmihailenco/msgpack/v5"
)

// tierEvent is one entry of kvbm_leader_take_events, a msgpack array:
// [removed, tier (2: host G2, 3: disk G3, 4: object store G4), seq_hash,
// parent (nil for the first block of a sequence, a removal or a G4 block:
// the G4 registry knows hashes only), tokens (G2/G3 stores only)].
type tierEvent struct {
	_msgpack struct{} `msgpack:",as_array"`
	Removed  bool
	Tier     uint8
	SeqHash  uint64
	Parent   *uint64
	Tokens   []uint32
}

// tierEventsReply is kvbm_leader_take_events' answer: the events since the
// last call, oldest first, and the events dropped so far because nobody
// drained them (monotonic).
type tierEventsReply struct {
	_msgpack struct{} `msgpack:",as_array"`
	Events   []tierEvent
	Dropped  uint64
}

// kvbm_leader_take_events drains the G2/G3/G4 store and removal events the
// leader kept since the last call (a leader created with "tier_events"),
// msgpack-encoded (tierEventsReply); without tier events the answer is
// empty.
//
//export kvbm_leader_take_events
func kvbm_leader_take_events(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_leader_take_events", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	if h.n.TierEvents == nil {
		cBuffer(nil, out, outLen)
		return statusOK
	}
	evs := h.n.TierEvents.Drain()
	rep := tierEventsReply{Events: make([]tierEvent, len(evs)), Dropped: h.n.TierEvents.Dropped()}
	for i, ev := range evs {
		te := tierEvent{Removed: ev.Removed, Tier: uint8(ev.Holder), SeqHash: ev.SeqHash}
		if !ev.Removed {
			te.Tokens = ev.Tokens
			if ev.HasParent {
				p := ev.Parent
				te.Parent = &p
			}
		}
		rep.Events[i] = te
	}
	b, _ := msgpack.Marshal(&rep) // plain values: encoding cannot fail
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_worker_stats returns JSON: this worker's transfer totals per
// direction since it was created (worker.DirectionStats by direction).
//
//export kvbm_worker_stats
func kvbm_worker_stats(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_stats", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	b, _ := json.Marshal(map[string]any{"directions": h.W.TransferStats(), "bytes_per_block": h.info.BytesPerBlock})
	cBuffer(b, out, outLen)
	return statusOK
}
