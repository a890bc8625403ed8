package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvbm/kvbm/goext/leader"
)

// stepUpdate is one scheduled request, msgpack-encoded by the Python adapter
// as an array: [req_id, new_tokens, new_block_ids, num_computed,
// num_scheduled, priority, salt, resumed, known_tokens, groups]; the last two
// may be left out (0 and nil). known_tokens: new_tokens follow the first
// known_tokens tokens the leader got at kvbm_leader_match (each token
// crosses once); groups: nil, or [replace, [[block ids of group 0], …]]
// (leader.GroupBlocks).
type stepUpdate struct {
	ReqID        string
	NewTokens    []uint32
	NewBlockIDs  []int64
	NumComputed  int
	NumScheduled int
	Priority     rowPriority
	Salt         uint64
	Resumed      bool
	KnownTokens  int
	Groups       *rowGroups
}

type rowGroups struct {
	_msgpack struct{} `msgpack:",as_array"`
	Replace  bool
	Blocks   [][]int64
}

func (u *stepUpdate) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 8 || n > 10 {
		return fmt.Errorf("step row of %d fields, want 8 to 10", n) // errprefix: wrapped by kvbm_leader_step
	}
	*u = stepUpdate{}
	fields := []any{&u.ReqID, &u.NewTokens, &u.NewBlockIDs, &u.NumComputed, &u.NumScheduled, &u.Priority, &u.Salt,
		&u.Resumed, &u.KnownTokens, &u.Groups}
	for _, f := range fields[:n] {
		if err := dec.Decode(f); err != nil {
			return err
		}
	}
	return nil
}

// rowPriority is the priority field of a step row: nil when the engine gives
// no priorities (vLLM: the offload filter does not apply), a list with the
// priority of each new block id (TensorRT-LLM's RequestData.priorities), or
// one integer that every new block id of the row has.
type rowPriority struct {
	perBlock []int
	all      int
	hasAll   bool
}

func (p *rowPriority) DecodeMsgpack(dec *msgpack.Decoder) error {
	*p = rowPriority{}
	code, err := dec.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case code == msgpcode.Nil:
		return dec.DecodeNil()
	case msgpcode.IsFixedArray(code) || code == msgpcode.Array16 || code == msgpcode.Array32:
		return dec.Decode(&p.perBlock)
	default:
		p.all, err = dec.DecodeInt()
		p.hasAll = err == nil
		return err
	}
}

// forBlocks is the leader's RequestUpdate.Priorities for a row with n new
// block ids.
func (p rowPriority) forBlocks(n int) []int {
	if !p.hasAll {
		return p.perBlock
	}
	out := make([]int, n)
	for i := range out {
		out[i] = p.all
	}
	return out
}

// stepInput is [updates, finished_loading_ids, load_error_blocks,
// alloc_groups]; alloc_groups (may be left out): request id → the blocks of
// every KV cache group allocated for its load (leader.NoteAllocGroups).
type stepInput struct {
	Updates     []stepUpdate
	Loaded      []string
	LoadErrors  []int64
	AllocGroups map[string][][]int64
}

func (si *stepInput) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 3 || n > 4 {
		return fmt.Errorf("step input of %d fields, want 3 or 4", n) // errprefix: wrapped by kvbm_leader_step
	}
	*si = stepInput{}
	fields := []any{&si.Updates, &si.Loaded, &si.LoadErrors, &si.AllocGroups}
	for _, f := range fields[:n] {
		if err := dec.Decode(f); err != nil {
			return err
		}
	}
	return nil
}

// kvbm_leader_step plans one engine step; returns the encoded plan for workers.
//
//export kvbm_leader_step
func kvbm_leader_step(hd C.uint64_t, in unsafe.Pointer, inLen C.int64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkIn("kvbm_leader_step", "update buffer", in, inLen),
		checkOut("kvbm_leader_step", ptr(out), ptr(outLen))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	var si stepInput
	if err := msgpack.Unmarshal(goBytes(in, inLen), &si); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_step: decode updates: %v", err), errOut)
	}
	if len(si.LoadErrors) > 0 {
		h.l.LoadErrors(si.LoadErrors)
	}
	if len(si.Loaded) > 0 {
		h.l.LoadsFinished(si.Loaded)
	}
	for id, blocks := range si.AllocGroups {
		h.l.NoteAllocGroups(id, blocks)
	}
	ups := make([]leader.RequestUpdate, len(si.Updates))
	for i, u := range si.Updates {
		ups[i] = leader.RequestUpdate{
			ReqID: u.ReqID, NewTokens: u.NewTokens, NewBlockIDs: u.NewBlockIDs,
			NumComputedTokens: u.NumComputed, NumScheduledTokens: u.NumScheduled,
			Priorities: u.Priority.forBlocks(len(u.NewBlockIDs)), Salt: u.Salt, Resumed: u.Resumed,
			KnownTokens: u.KnownTokens,
		}
		if g := u.Groups; g != nil {
			ups[i].Groups = &leader.GroupBlocks{Replace: g.Replace, Blocks: g.Blocks}
		}
	}
	b, err := h.l.Step(ups)
	if err != nil {
		return finish(err, errOut)
	}
	h.publishFigures()
	cBuffer(b, out, outLen)
	return statusOK
}
