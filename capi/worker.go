package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/wire"
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
var newDeviceCopier func(eng *layout.Engine, env map[string]string) (worker.G1Copier, error)

type workerHandle struct {
	lifetime
	g1      worker.G1Copier // nil: G1 is host memory
	g4Close func()          // releases the G4 store; nil without one
	g4      *object.Store
	w       *worker.Worker
	member  *wire.Member // the side channel; nil without one
	m       *metrics.Metrics
	layout  *layout.Engine
	info    workerInfo // kvbm_worker_info's answer but for DiskDegraded
	// recovered is the persistent disk tier's recovered index (persist.go).
	recovered []byte
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
	spec := layout.Spec{Kind: kind, NumBlocks: o.NumBlocks, BlockSize: o.BlockSize, DtypeBytes: o.DtypeBytes,
		LayerGroups: o.LayerGroups}
	for _, t := range o.Tensors {
		spec.Tensors = append(spec.Tensors, layout.Tensor{Ptr: uintptr(t.Ptr), Shape: t.Shape, Strides: t.Strides})
	}
	eng, err := layout.NewEngine(spec)
	if err != nil {
		return finish(err, errOut)
	}
	nw := max(o.NumWorkers, 1)
	hostBlocks, diskBlocks, err := cfg.TierBlocks(eng.BytesPerBlock(), nw)
	if err != nil {
		return finish(withCode(statusConfig, err), errOut)
	}
	log := kvbmLogger()
	m := workerMetrics()
	var g1c worker.G1Copier
	if newDeviceCopier != nil {
		if g1c, err = newDeviceCopier(eng, o.Env); err != nil {
			return finish(withCode(statusIO, err), errOut)
		}
		if err := checkGroupsCopier(eng, g1c); err != nil {
			return finish(err, errOut)
		}
	}
	fp := fingerprint.FromEngine(o.Model, o.DType, eng, nw, o.Rank)
	if err := cfg.CheckObject(); err != nil {
		return finish(withCode(statusConfig, err), errOut)
	}
	var g4s *object.Store
	var g4Close func()
	if cfg.Object.Enabled {
		if g4s, g4Close, err = openG4(cfg, fp.Sum(), eng.BytesPerBlock(), o.WorkerID, log); err != nil {
			return finish(err, errOut)
		}
	}
	diskKey, err := g3Key(cfg)
	if err != nil {
		if g4Close != nil {
			g4Close()
		}
		return finish(withCode(statusConfig, err), errOut)
	}
	w, err := worker.New(worker.Options{
		G4:          g4s,
		Fingerprint: fp,
		Rank:        o.Rank, HostBlocks: hostBlocks, DiskBlocks: diskBlocks, DiskDir: cfg.DiskCacheDir,
		DiskPersist: cfg.DiskPersist, DiskKey: diskKey, DiskZeroFill: cfg.DiskZerofillFallback,
		DiskOpenDirect: cfg.DiskAllocatorType == config.DiskAllocatorOpenDirect, NUMA: cfg.EnableNUMA,
		DisableODirect: cfg.DiskDisableODirect, MaxConcurrent: cfg.MaxConcurrentTransfers,
		BatchSize: cfg.MaxTransferBatchSize, Logger: log, Metrics: m, G1: g1c,
	})
	if err != nil {
		if g1c != nil {
			_ = g1c.Close()
		}
		if g4Close != nil {
			g4Close()
		}
		return finish(withCode(statusConfig, err), errOut)
	}
	if err := w.RegisterG1(eng); err != nil {
		_ = w.Close()
		if g4Close != nil {
			g4Close()
		}
		return finish(withCode(statusIO, err), errOut)
	}
	if o.Rank == 0 && g4Close != nil {
		// A leader in this process looks G4 up under rank 0's fingerprint.
		sum, release := fp.Sum(), g4Close
		setRank0Fingerprint(sum)
		g4Close = func() { clearRank0Fingerprint(sum); release() }
	}
	var recovered []byte
	if w.DiskPersistent() {
		recovered = offerRecovered(o.Rank, nw, w.Recovered())
	}
	log.Info("kvbm worker ready", "rank", o.Rank, "layout", eng.String(), "bytes_per_block", eng.BytesPerBlock(),
		"host_blocks", hostBlocks, "disk_blocks", diskBlocks, "disk_file", w.DiskPath(),
		"fingerprint", fp.Sum().String(), "fingerprint_of", fp.Describe())
	g1desc := "host"
	if g1c != nil {
		g1desc = fmt.Sprint(g1c)
	}
	h := &workerHandle{g1: g1c, g4Close: g4Close, g4: g4s, w: w, m: m, layout: eng, recovered: recovered, info: workerInfo{
		G4:            g4s != nil,
		G1:            g1desc,
		BytesPerBlock: eng.BytesPerBlock(), HostBlocks: hostBlocks, DiskBlocks: diskBlocks,
		DiskPath: w.DiskPath(), Layout: eng.String(), NumLayers: eng.NumLayers,
		Fingerprint: fp.Sum().String(), DiskPersistent: w.DiskPersistent(),
		DiskRecoveredBlocks: len(w.Recovered().Blocks),
	}}
	if o.SideChannel != nil {
		if h.member, err = connectSideChannel(o.SideChannel, cfg, h, o.Rank, nw); err != nil {
			h.free()
			return finish(err, errOut)
		}
	}
	*out = newHandle(h)
	return statusOK
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
func (h *workerHandle) interrupt() {
	if h.member != nil {
		_ = h.member.Close()
	}
}

// free closes the side channel first (an operation waiting for its engine
// step returns, and no new one arrives), then the worker.
func (h *workerHandle) free() {
	if h.member != nil {
		_ = h.member.Close()
	}
	_ = h.w.Close()
	h.w = nil
	if h.g4Close != nil {
		h.g4Close()
	}
}

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
	info.DiskDegraded = h.w.DiskDegraded()
	if h.g1 != nil {
		info.G1 = fmt.Sprint(h.g1) // the copier's description may change as it works
	}
	if h.member != nil {
		info.SideChannel = memberInfo(h.member)
	}
	b, _ := json.Marshal(info)
	cBuffer(b, out, outLen)
	return statusOK
}

//export kvbm_worker_bind
func kvbm_worker_bind(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn("kvbm_worker_bind", "plan buffer", buf, n); err != nil {
		return finish(err, errOut)
	}
	if err := h.w.BindStep(goBytes(buf, n)); err != nil {
		return finish(errorf(statusInvalid, "kvbm_worker_bind: %v", err), errOut)
	}
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
	h.w.StartLoad()
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
	h.w.WaitLoads()
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
	h.w.WaitForSave()
	return statusOK
}

// kvbm_worker_finished returns msgpack [loaded_request_ids, load_error_g1_blocks].
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
	loaded, errs := h.w.Finished()
	if len(loaded) == 0 && len(errs) == 0 {
		*out, *outLen = nil, 0
		return statusOK
	}
	b, err := msgpack.Marshal([]any{loaded, errs})
	if err != nil {
		return finish(fmt.Errorf("encode finished: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}
