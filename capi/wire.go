package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"time"
	"unsafe"

	"github.com/kvbm/kvbm/goext/wire"
)

// The leader⇄worker side channel (goext/wire) for engines with several
// tensor-parallel ranks. The scheduler side: kvbm_wire_leader_new binds,
// kvbm_wire_leader_handshake waits for every rank and returns the sizes the
// leader is then created with, kvbm_wire_leader_broadcast runs an encoded
// plan on every rank. The worker side: kvbm_wire_worker_connect attaches a
// worker handle (kvbm_worker_new) and answers in the background.

// wireLeaderOptions is the JSON kvbm_wire_leader_new takes.
type wireLeaderOptions struct {
	NumWorkers int `json:"num_workers"`
	// Transport: "auto" (in-process for one worker), "tcp" or "inproc".
	Transport string `json:"transport"`
	// Heartbeat tuning; 0: defaults (500 ms pings; suspected after
	// DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS of silence).
	PingIntervalMs int64 `json:"ping_interval_ms"`
	SuspectAfterMs int64 `json:"suspect_after_ms"`
	// Secret authenticates the side channel (the engine instance's id);
	// DYN_KVBM_LEADER_WORKER_SECRET, when set, is used instead.
	Secret string            `json:"secret"`
	Env    map[string]string `json:"env"`
}

type wireLeaderHandle struct {
	l *wire.Coordinator
}

func ms(v int64) time.Duration { return time.Duration(v) * time.Millisecond }

// timeoutCtx is ctx bounded by timeoutMs (≤ 0: no bound beyond the callee's own).
func timeoutCtx(timeoutMs C.int64_t) (context.Context, context.CancelFunc) {
	if timeoutMs <= 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), ms(int64(timeoutMs)))
}

//export kvbm_wire_leader_new
func kvbm_wire_leader_new(optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_leader_new", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var o wireLeaderOptions
	if err := parseOptions("kvbm_wire_leader_new", optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	cfg, err := configFor(o.Env, false)
	if err != nil {
		return finish(err, errOut)
	}
	tr, err := wire.ParseTransport(o.Transport)
	if err != nil {
		return finish(errorf(statusInvalid, "kvbm_wire_leader_new: %v", err), errOut)
	}
	opts := wire.CoordinatorOptionsFrom(cfg, max(o.NumWorkers, 1))
	opts.Transport = tr
	opts.PingInterval = ms(o.PingIntervalMs)
	opts.Secret = cmp.Or(opts.Secret, o.Secret) // DYN_KVBM_LEADER_WORKER_SECRET wins
	if o.SuspectAfterMs > 0 {
		opts.SuspectAfter = ms(o.SuspectAfterMs)
	}
	opts.Logger = kvbmLogger()
	l, err := wire.Listen(opts)
	if err != nil {
		return finish(withCode(statusIO, err), errOut)
	}
	*out = newHandle(&wireLeaderHandle{l: l})
	return statusOK
}

func wireLeaderOf(hd C.uint64_t) (*wireLeaderHandle, error) { return live[*wireLeaderHandle](hd) }

// wireHandshake is the JSON kvbm_wire_leader_handshake returns (Python: the
// Handshake dataclass in python/kvbm/_wire.py).
type wireHandshake struct {
	NumWorkers      int   `json:"num_workers"`
	BytesPerBlock   int64 `json:"bytes_per_block"`
	NumDeviceBlocks int   `json:"num_device_blocks"`
	NumHostBlocks   int   `json:"num_host_blocks"`
	NumDiskBlocks   int   `json:"num_disk_blocks"`
}

// kvbm_wire_leader_handshake waits until every rank reported and allocated
// and returns JSON {num_workers, bytes_per_block, num_device_blocks,
// num_host_blocks, num_disk_blocks}. DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS
// bounds the handshake from the first call (then it fails naming the ranks);
// when timeoutMs > 0 ends the wait first, it returns OK with an empty buffer
// and a later call resumes, so a caller can wait in short slices.
//
//export kvbm_wire_leader_handshake
func kvbm_wire_leader_handshake(hd C.uint64_t, timeoutMs C.int64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, err := wireLeaderOf(hd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_leader_handshake", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	ctx, cancel := timeoutCtx(timeoutMs)
	defer cancel()
	hs, err := h.l.Handshake(ctx)
	if errors.Is(err, wire.ErrHandshakePending) {
		*out, *outLen = nil, 0 // not yet: an empty answer, call again
		return statusOK
	}
	if err != nil {
		code := statusConfig // workers disagree, allocation failed, no tier
		if errors.Is(err, wire.ErrHandshakeTimeout) || errors.Is(err, wire.ErrClosed) {
			code = statusIO
		}
		return finish(withCode(code, err), errOut)
	}
	b, _ := json.Marshal(wireHandshake{
		NumWorkers: hs.NumWorkers, BytesPerBlock: hs.BytesPerBlock, NumDeviceBlocks: hs.NumDeviceBlocks,
		NumHostBlocks: hs.NumHostBlocks, NumDiskBlocks: hs.NumDiskBlocks,
	})
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_wire_leader_broadcast runs an encoded plan.Step on every rank and
// returns when all acked. A dead or suspected rank is KVBM_ERR_STATE naming
// it (nothing is sent); a rank's execution error is KVBM_ERR_IO naming the rank.
//
//export kvbm_wire_leader_broadcast
func kvbm_wire_leader_broadcast(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, timeoutMs C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, err := wireLeaderOf(hd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn("kvbm_wire_leader_broadcast", "operation buffer", buf, n); err != nil {
		return finish(err, errOut)
	}
	ctx, cancel := timeoutCtx(timeoutMs)
	defer cancel()
	// Broadcast copies nothing it keeps past its return on TCP and clones
	// in-process; the C buffer is only read during the call.
	if err := h.l.Broadcast(ctx, goBytes(buf, n)); err != nil {
		code := statusIO
		if errors.Is(err, wire.ErrRankDead) || errors.Is(err, wire.ErrRankSuspect) ||
			errors.Is(err, wire.ErrNotReady) || errors.Is(err, wire.ErrClosed) {
			code = statusState
		}
		return finish(withCode(code, err), errOut)
	}
	return statusOK
}

// wireLeaderInfo is the JSON kvbm_wire_leader_info returns (Python:
// WireLeaderInfo in python/kvbm/_wire.py).
type wireLeaderInfo struct {
	Transport      string `json:"transport"`
	PubPort        int    `json:"pub_port"`
	AckPort        int    `json:"ack_port"`
	Healthy        bool   `json:"healthy"`
	DeadRanks      []int  `json:"dead_ranks"`
	SuspectRanks   []int  `json:"suspect_ranks"`
	ForgedMessages uint64 `json:"forged_messages"`
}

// kvbm_wire_leader_info returns JSON {transport, pub_port, ack_port,
// healthy, dead_ranks, suspect_ranks, forged_messages}.
//
//export kvbm_wire_leader_info
func kvbm_wire_leader_info(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, err := wireLeaderOf(hd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_leader_info", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	ep := h.l.Endpoint()
	b, _ := json.Marshal(wireLeaderInfo{
		Transport: h.l.Transport().String(), PubPort: ep.PubPort, AckPort: ep.AckPort,
		Healthy: h.l.Healthy(), DeadRanks: nonNil(h.l.DeadRanks()), SuspectRanks: nonNil(h.l.SuspectRanks()),
		ForgedMessages: h.l.Forged(),
	})
	cBuffer(b, out, outLen)
	return statusOK
}

//export kvbm_wire_leader_free
func kvbm_wire_leader_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	if h, err := handle[*wireLeaderHandle](hd); err == nil {
		_ = h.l.Close()
		deleteHandle(hd)
	}
}

// wireWorkerOptions is the JSON kvbm_wire_worker_connect takes.
type wireWorkerOptions struct {
	Rank       int               `json:"rank"`
	NumWorkers int               `json:"num_workers"`
	Transport  string            `json:"transport"`
	Secret     string            `json:"secret"` // as in wireLeaderOptions
	Env        map[string]string `json:"env"`
}

type wireWorkerHandle struct {
	w *wire.Member
}

// kvbm_wire_worker_connect attaches the worker handle workerHd (created by
// kvbm_worker_new, which already allocated this rank's tiers from its own
// view of the configuration) to the leader's side channel. It returns at
// once; the handshake completes in the background when the leader runs it.
// In the handshake the rank checks that the leader's sizes equal its own
// (the leader reports a mismatch naming the rank).
//
// Broadcast operations run on the worker through worker.Run: outside the
// engine's bound step (the engine's get_finished never sees them) and
// serialised with its bind/start_load/wait_for_save, so they may arrive at
// any time, also in the middle of an engine step. Free this handle before
// the worker handle.
//
//export kvbm_wire_worker_connect
func kvbm_wire_worker_connect(workerHd C.uint64_t, optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	wh, err := workerOf(workerHd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_worker_connect", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var o wireWorkerOptions
	if err := parseOptions("kvbm_wire_worker_connect", optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	cfg, err := configFor(o.Env, false)
	if err != nil {
		return finish(err, errOut)
	}
	tr, err := wire.ParseTransport(o.Transport)
	if err != nil {
		return finish(errorf(statusInvalid, "kvbm_wire_worker_connect: %v", err), errOut)
	}
	h := &wireWorkerHandle{}
	w, err := wire.Connect(wire.MemberOptions{
		Rank: o.Rank, WorldSize: max(o.NumWorkers, 1), NumDeviceBlocks: wh.layout.NumBlocks,
		BytesPerBlock: wh.layout.BytesPerBlock(), Endpoint: wire.EndpointFrom(cfg), Transport: tr,
		Secret: cmp.Or(cfg.LeaderWorkerSecret, o.Secret), Logger: kvbmLogger(),
		// The worker already sized its tiers; the side channel runs straight into it.
		Allocate: wire.ExpectSizes(wh.info.HostBlocks, wh.info.DiskBlocks),
		Execute:  wire.RunOn(wh.w),
	})
	if err != nil {
		return finish(err, errOut)
	}
	h.w = w
	*out = newHandle(h)
	return statusOK
}

func wireWorkerOf(hd C.uint64_t) (*wireWorkerHandle, error) { return live[*wireWorkerHandle](hd) }

// wireLeaderMetadata is the JSON kvbm_wire_worker_wait_ready returns
// (Python: the LeaderMetadata dataclass in python/kvbm/_wire.py).
type wireLeaderMetadata struct {
	NumHostBlocks int `json:"num_host_blocks"`
	NumDiskBlocks int `json:"num_disk_blocks"`
	WorldSize     int `json:"world_size"`
}

// kvbm_wire_worker_wait_ready blocks until the handshake completed for this
// rank (timeoutMs > 0 bounds it) and returns JSON {num_host_blocks,
// num_disk_blocks, world_size}.
//
//export kvbm_wire_worker_wait_ready
func kvbm_wire_worker_wait_ready(hd C.uint64_t, timeoutMs C.int64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, err := wireWorkerOf(hd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_worker_wait_ready", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	ctx, cancel := timeoutCtx(timeoutMs)
	defer cancel()
	md, err := h.w.WaitReady(ctx)
	if err != nil {
		return finish(withCode(statusIO, err), errOut)
	}
	b, _ := json.Marshal(wireLeaderMetadata{NumHostBlocks: md.NumHostBlocks, NumDiskBlocks: md.NumDiskBlocks, WorldSize: md.WorldSize})
	cBuffer(b, out, outLen)
	return statusOK
}

// wireWorkerInfo is the JSON kvbm_wire_worker_info returns (Python:
// WireWorkerInfo in python/kvbm/_wire.py).
type wireWorkerInfo struct {
	Ready          bool   `json:"ready"`
	Stopped        bool   `json:"stopped"`
	Error          string `json:"error"` // "" while healthy
	ForgedMessages uint64 `json:"forged_messages"`
	Reconnects     uint64 `json:"reconnects"`
}

// kvbm_wire_worker_info returns JSON {ready, stopped, error, forged_messages,
// reconnects}: reconnects counts subscriptions redialed after the leader's
// side channel dropped or went silent.
//
//export kvbm_wire_worker_info
func kvbm_wire_worker_info(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, err := wireWorkerOf(hd)
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_wire_worker_info", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	info := wireWorkerInfo{Ready: isClosed(h.w.Ready()), Stopped: isClosed(h.w.Done()),
		ForgedMessages: h.w.Forged(), Reconnects: h.w.Reconnects()}
	if e := h.w.Err(); e != nil {
		info.Error = e.Error()
	}
	b, _ := json.Marshal(info)
	cBuffer(b, out, outLen)
	return statusOK
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

//export kvbm_wire_worker_free
func kvbm_wire_worker_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	if h, err := handle[*wireWorkerHandle](hd); err == nil {
		_ = h.w.Close()
		deleteHandle(hd)
	}
}

// nonNil makes an empty list encode as [] rather than null.
func nonNil(r []int) []int {
	if r == nil {
		return []int{}
	}
	return r
}
