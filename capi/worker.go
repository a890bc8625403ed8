package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/node"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/worker"
)

// workerOptions is the JSON the Python adapter passes to kvbm_worker_new:
// the engine's KV tensors (addresses stay owned by the engine) and this
// rank's place in the tensor-parallel group.
type workerOptions struct {
	Rank       int            `json:"rank"`
	NumWorkers int            `json:"num_workers"`
	Kind       string         `json:"kind"`
	NumBlocks  int            `json:"num_blocks"`
	BlockSize  int            `json:"block_size"`
	DtypeBytes int            `json:"dtype_bytes"`
	Tensors    []tensorOption `json:"tensors"`
	// LayerGroups is each tensor's KV cache group (layout.Spec.LayerGroups);
	// absent with one group.
	LayerGroups []int `json:"layer_groups,omitempty"`
	// GroupKinds names each group's attention kind (layout.Spec.GroupKinds):
	// part of the fingerprint; absent with one group.
	GroupKinds []string `json:"group_kinds,omitempty"`
	// Model and DType identify the weights and element type (the engine's
	// model name or path and revision; e.g. "torch.bfloat16"): with the
	// layout they form the fingerprint of blocks kept beyond this process.
	Model string `json:"model"`
	DType string `json:"dtype"`
	// Env holds kvbm's variables as the caller sees them (see loadConfig).
	Env map[string]string `json:"env"`
	// WorkerID is the engine instance's id ({worker_id} in DYN_KVBM_OBJECT_BUCKET).
	WorkerID uint64 `json:"worker_id"`
	// SideChannel, when set, connects this rank to the leader's side
	// channel (TP > 1, the leader in another process): kvbm_worker_new
	// returns at once, the handshake completes when the leader runs it, and
	// the leader's background operations run on this worker.
	SideChannel *workerSideChannelOptions `json:"side_channel,omitempty"`
}

type tensorOption struct {
	Ptr     uint64  `json:"ptr"`
	Shape   []int64 `json:"shape"`
	Strides []int64 `json:"strides"`
}

// newDeviceCopier returns the G1 copier for engine tensors in GPU memory, or
// nil when they are host memory. Only the CUDA build (worker_cuda.go) sets it.
var newDeviceCopier func(eng *layout.Engine, cfg *config.Config) (worker.G1Copier, error)

// nodeDeps are the assembly's dependencies as the C ABI provides them: the
// process's registry, kvbm's logger, the CUDA build's copier.
func nodeDeps() node.Deps {
	return node.Deps{Logger: kvbmLogger(), NewCopier: newDeviceCopier,
		TuneStore: func(o *config.Object, so *object.StoreOptions) { g4StoreOptions(o, so) }}
}

type workerHandle struct {
	lifetime
	*node.Worker
	info workerInfo  // kvbm_worker_info's answer but for DiskDegraded
	figs figureSlots // figures.go
}

//export kvbm_worker_new
func kvbm_worker_new(optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_new", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var o workerOptions
	if err := parseOptions("kvbm_worker_new", optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	cfg, err := configFor(o.Env, true)
	if err != nil {
		return finish(err, errOut)
	}
	kind, err := layout.ParseKind(o.Kind)
	if err != nil {
		return finish(err, errOut)
	}
	spec := node.WorkerSpec{Rank: o.Rank, NumWorkers: o.NumWorkers, Model: o.Model, DType: o.DType, WorkerID: o.WorkerID,
		Layout: layout.Spec{Kind: kind, NumBlocks: o.NumBlocks, BlockSize: o.BlockSize, DtypeBytes: o.DtypeBytes,
			LayerGroups: o.LayerGroups, GroupKinds: o.GroupKinds}}
	for _, t := range o.Tensors {
		spec.Layout.Tensors = append(spec.Layout.Tensors, layout.Tensor{Ptr: uintptr(t.Ptr), Shape: t.Shape, Strides: t.Strides})
	}
	if sc := o.SideChannel; sc != nil {
		spec.SideChannel = &node.WorkerSideChannel{Transport: sc.Transport, Secret: sc.Secret}
	}
	n, err := node.NewWorker(cfg, spec, nodeDeps())
	if err != nil {
		return finish(err, errOut)
	}
	h := &workerHandle{Worker: n, info: newWorkerInfo(n), figs: newFigureSlots(workerFigureSlots)}
	n.W.PublishTransferSeq(h.figs.word(figTransferSeq))
	*out = newHandle(h)
	return statusOK
}

func newWorkerInfo(n *node.Worker) workerInfo {
	g1desc := "host"
	if n.G1 != nil {
		g1desc = fmt.Sprint(n.G1)
	}
	return workerInfo{
		G4:            n.G4 != nil,
		G1:            g1desc,
		BytesPerBlock: n.Layout.BytesPerBlock(), HostBlocks: n.HostBlocks, DiskBlocks: n.DiskBlocks,
		DiskPath: n.W.DiskPath(), Layout: n.Layout.String(), NumLayers: n.Layout.NumLayers,
		Fingerprint: n.Fingerprint.String(), DiskPersistent: n.W.DiskPersistent(),
		DiskRecoveredBlocks: len(n.W.Recovered().Blocks),
	}
}

func workerOf(hd C.uint64_t) (*workerHandle, func(), error) {
	return acquire[*workerHandle](hd)
}

//export kvbm_worker_free
func kvbm_worker_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	freeHandle(hd, (*workerHandle).interrupt, (*workerHandle).free)
}

// interrupt runs when a free begins, before it waits for the calls in
// progress: an operation of the side channel waiting for the engine's
// step gives up, and no new one arrives.
func (h *workerHandle) interrupt() { h.Interrupt() }

// free closes the side channel first (an operation waiting for its engine
// step returns, and no new one arrives), then the worker, then its G4 store.
func (h *workerHandle) free() { h.Close() }

// workerInfo is the JSON kvbm_worker_info returns (Python: WorkerInfo in
// python/kvbm/_core.py).
type workerInfo struct {
	DiskDegraded        bool   `json:"disk_degraded"`
	G1                  string `json:"g1"` // "host", or the device copier
	BytesPerBlock       int64  `json:"bytes_per_block"`
	HostBlocks          int    `json:"host_blocks"`
	DiskBlocks          int    `json:"disk_blocks"`
	DiskPath            string `json:"disk_path"`
	Layout              string `json:"layout"`
	NumLayers           int    `json:"num_layers"`
	Fingerprint         string `json:"fingerprint"`
	DiskPersistent      bool   `json:"disk_persistent"`
	DiskRecoveredBlocks int    `json:"disk_recovered_blocks"`
	G4                  bool   `json:"g4"`
	// SideChannel: with one (workerOptions.SideChannel).
	SideChannel *workerSideChannelInfo `json:"side_channel,omitempty"`
}

//export kvbm_worker_info
func kvbm_worker_info(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_info", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	info := h.info
	info.DiskDegraded = h.W.DiskDegraded()
	if h.G1 != nil {
		info.G1 = fmt.Sprint(h.G1) // the copier's description may change as it works
	}
	if h.Member != nil {
		info.SideChannel = memberInfo(h.Member)
	}
	b, _ := json.Marshal(info)
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_worker_bind hands the worker a step's plan (goext/plan, as the
// leader's kvbm_leader_step returned it) and returns what the engine adapter
// must act on, so that the plan is decoded once, here: msgpack [loads,
// start, save], loads = [[request id, [G1 blocks]], …] (the loads the
// adapter must later report), start/save = whether
// kvbm_worker_start_load/_wait_for_save have work for this step. Nothing
// (out_len 0) when there is none of it.
//
//export kvbm_worker_bind
func kvbm_worker_bind(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkIn("kvbm_worker_bind", "plan buffer", buf, n),
		checkOut("kvbm_worker_bind", ptr(out), ptr(outLen))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	bound, err := h.W.BindPlan(goBytes(buf, n))
	if err != nil {
		return finish(errorf(statusInvalid, "kvbm_worker_bind: %v", err), errOut)
	}
	*out, *outLen = nil, 0
	if bound.Empty() {
		return statusOK
	}
	b, err := msgpack.Marshal([]any{bound.Loads, bound.Start, bound.Save})
	if err != nil {
		return finish(fmt.Errorf("encode bound step: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}

//export kvbm_worker_start_load
func kvbm_worker_start_load(hd C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	h.W.StartLoad()
	return statusOK
}

// kvbm_worker_wait_loads blocks until every started load completed (engines
// that need the KV before the forward pass, e.g. synchronous loads).
//
//export kvbm_worker_wait_loads
func kvbm_worker_wait_loads(hd C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	h.W.WaitLoads()
	return statusOK
}

//export kvbm_worker_wait_for_save
func kvbm_worker_wait_for_save(hd C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	h.W.WaitForSave()
	return statusOK
}

// kvbm_worker_finished returns msgpack [loaded_request_ids,
// load_error_g1_blocks, failed_request_ids] (the loaded requests with a
// failed G1 block), or nothing when no load finished.
//
//export kvbm_worker_finished
func kvbm_worker_finished(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_finished", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	f := h.W.FinishedLoads()
	if len(f.Loaded) == 0 && len(f.Errors) == 0 {
		*out, *outLen = nil, 0
		return statusOK
	}
	b, err := msgpack.Marshal(f)
	if err != nil {
		return finish(fmt.Errorf("encode finished: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}
