package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/wire"
)

// leaderOptions is the JSON the Python adapter passes to kvbm_leader_new.
type leaderOptions struct {
	BlockSize     int    `json:"block_size"`
	BytesPerBlock int64  `json:"bytes_per_block"`
	NumWorkers    int    `json:"num_workers"`
	WorkerID      uint64 `json:"worker_id"`
	// Background: G2→G3 moves leave the step plans; they are registered
	// only once every rank ran them (implied by SideChannel).
	Background bool `json:"background"`
	// SideChannel, when set, binds the leader⇄worker side channel for
	// NumWorkers ranks (TP > 1): kvbm_leader_wait_ready then runs the
	// handshake and creates the leader with the sizes every rank reported
	// (BytesPerBlock is taken from it), and the leader runs its background
	// operations over it.
	SideChannel *leaderSideChannelOptions `json:"side_channel,omitempty"`
	// Consolidator, when set, starts the KV event consolidator and feeds it
	// the leader's G2/G3 events.
	Consolidator *consolidatorOptions `json:"consolidator,omitempty"`
	// Env holds kvbm's variables as the caller sees them (see loadConfig).
	Env map[string]string `json:"env"`
	// Fingerprint (hex) of rank 0's blocks, for G4 lookups; empty: the
	// rank 0 worker of this process, if there is one.
	Fingerprint string `json:"fingerprint,omitempty"`
	// G4Async: the engine asks again when kvbm_leader_match answers -1
	// (a G4 lookup is running); vLLM does.
	G4Async bool `json:"g4_async,omitempty"`
	// LoadFullHit: a prompt cached whole loads every block and is reported
	// one token short (leader.Options.LoadFullHit); vLLM sets it.
	LoadFullHit bool `json:"load_full_hit,omitempty"`
	// TierEvents: keep the G2/G3 store and removal events for
	// kvbm_leader_take_events (tierevents.go); the vLLM adapter publishes
	// them in the engine's KV event stream.
	TierEvents bool `json:"tier_events,omitempty"`
}

type leaderHandle struct {
	lifetime
	// l is set once, by kvbm_leader_new or (with a side channel) the
	// kvbm_leader_wait_ready that completed the handshake, before ready.
	l       *leader.Leader
	ready   atomic.Bool
	m       *metrics.Metrics
	metrics *metrics.Server
	once    sync.Once

	// With a side channel: the channel, the options the leader is created
	// with once the handshake completed, and its outcome. startMu orders
	// that creation with close.
	co      *wire.Coordinator
	opts    leaderOptions
	hs      wire.Handshake
	startMu sync.Mutex
	closed  bool

	consolidator *consolidator.Consolidator // nil unless started with the leader
	g4Close      func()                     // releases the G4 store; nil without one
	g4mu         sync.Mutex                 // kvbm_leader_set_g4_fingerprint vs close
	tierEvents   *events.Buffer             // nil unless leaderOptions.TierEvents

	// For a G4 store opened after start (kvbm_leader_set_g4_fingerprint).
	cfg           *config.Config
	bytesPerBlock int64
	workerID      uint64
}

func (h *leaderHandle) close() {
	h.once.Do(func() {
		h.startMu.Lock()
		h.closed = true
		l := h.l
		h.startMu.Unlock()
		// The leader first: its background loop cancels the operation in
		// flight (committed failed) and stops using the side channel.
		if l != nil {
			l.Close()
		}
		if h.co != nil {
			_ = h.co.Close()
		}
		h.release()
	})
}

// release stops what start started around the leader (metrics endpoint,
// consolidator, G4 store); each only once.
func (h *leaderHandle) release() {
	if h.metrics != nil {
		_ = h.metrics.Close()
		h.metrics = nil
	}
	if h.consolidator != nil {
		_ = h.consolidator.Close()
		h.consolidator = nil
	}
	h.g4mu.Lock()
	if h.g4Close != nil {
		h.g4Close()
		h.g4Close = nil
	}
	h.g4mu.Unlock()
}

//export kvbm_leader_new
func kvbm_leader_new(optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_leader_new", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var o leaderOptions
	if err := parseOptions("kvbm_leader_new", optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	cfg, err := configFor(o.Env, true)
	if err != nil {
		return finish(err, errOut)
	}
	log := kvbmLogger()
	cfg.LogOnce(func(format string, args ...any) { log.Info(fmt.Sprintf(format, args...)) })

	h := &leaderHandle{m: metrics.New(), cfg: cfg, opts: o}
	if o.SideChannel != nil {
		// The leader's sizes come from the handshake, which may wait for a
		// long time (DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS): only bind
		// here, so that a taken port fails at once, and let the caller wait
		// in kvbm_leader_wait_ready, in slices it can interrupt.
		co, err := listenSideChannel(o.SideChannel, cfg, max(o.NumWorkers, 1))
		if err != nil {
			return finish(err, errOut)
		}
		h.co = co
		*out = newHandle(h)
		return statusOK
	}
	if err := h.start(o, cfg, nil); err != nil {
		return finish(err, errOut)
	}
	*out = newHandle(h)
	return statusOK
}

// start creates the leader (and what it feeds: consolidator, G4, metrics
// endpoint); bc is its side channel, nil without one. On error everything
// started is released.
func (h *leaderHandle) start(o leaderOptions, cfg *config.Config, bc leader.Broadcaster) error {
	log := kvbmLogger()
	h.bytesPerBlock, h.workerID = o.BytesPerBlock, o.WorkerID
	var sink events.Sink = events.NopSink{}
	if o.Consolidator != nil {
		c, err := startConsolidator(o.Consolidator, cfg, h.m, log)
		if err != nil {
			return err
		}
		h.consolidator, sink = c, c
	}
	sink = h.withTierEvents(o, sink)
	g4opts, err := leaderG4(&o, cfg, h, log)
	if err != nil {
		h.release()
		return err
	}
	h.g4TierEvents(g4opts)
	l, err := leader.New(leader.Options{
		G4:               g4opts,
		Config:           cfg,
		BlockSize:        o.BlockSize,
		BytesPerBlock:    o.BytesPerBlock,
		NumWorkers:       max(o.NumWorkers, 1),
		Sink:             sink,
		Metrics:          h.m,
		Logger:           log,
		WorkerID:         o.WorkerID,
		Background:       o.Background,
		SideChannel:      bc,
		BroadcastTimeout: sideChannelTimeout(o.SideChannel),
		LoadFullHit:      o.LoadFullHit,
		ObserveTransfers: true, // this process's workers time their loads (goext/policy)
	})
	if err != nil {
		h.release()
		return withCode(statusConfig, err)
	}
	h.l = l
	if g4opts != nil {
		_ = object.RegisterMetrics(h.m.Registry)
	}
	restoreInProcess(l, cfg, max(o.NumWorkers, 1), h.m, log)
	if cfg.Metrics {
		// Transfer bytes and latency are measured by the workers of this
		// process (TP=1: the engine's only worker shares it).
		h.m.Also = workerMetrics().Families("kvbm_transfer_bytes", "kvbm_transfer_seconds",
			"kvbm_g3_load_unauthenticated_blocks")
		srv, err := h.m.ServeWith(cfg.MetricsAddr(), metrics.ServerOptionsFrom(cfg))
		if err != nil {
			// The cache works without its metrics endpoint; say why it is missing.
			log.Warn("kvbm metrics endpoint not started", "err", err)
		} else {
			h.metrics = srv
			log.Info("kvbm metrics endpoint", "url", "http://"+srv.Addr+"/metrics")
		}
	}
	h.ready.Store(true)
	return nil
}

func sideChannelTimeout(o *leaderSideChannelOptions) time.Duration {
	if o == nil {
		return 0
	}
	return ms(o.BroadcastTimeoutMs)
}

// kvbm_leader_wait_ready completes the start of a leader created with a
// side channel: it waits until every rank reported and allocated, then
// creates the leader with the sizes they reported. *outReady is 1 once the
// leader is ready (at once for a leader without a side channel, and on every
// later call), 0 when timeoutMs > 0 ended the wait first: call again to
// resume, so a caller can wait in short slices and stay interruptible.
// DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS bounds the handshake from the
// first call (then KVBM_ERR_IO naming the ranks that never answered); ranks
// that disagree or failed to allocate are KVBM_ERR_CONFIG. Every other leader
// call answers KVBM_ERR_STATE until the leader is ready.
//
//export kvbm_leader_wait_ready
func kvbm_leader_wait_ready(hd C.uint64_t, timeoutMs C.int64_t, outReady *C.int32_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := checkOut("kvbm_leader_wait_ready", ptr(outReady)); err != nil {
		return finish(err, errOut)
	}
	*outReady = 0
	h, done, err := acquire[*leaderHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if h.ready.Load() {
		*outReady = 1
		return statusOK
	}
	if h.co == nil { // a leader without a side channel is ready from kvbm_leader_new on
		return finish(errorf(statusState, "kvbm_leader_wait_ready: leader not ready and no side channel"), errOut)
	}
	ctx, cancel := timeoutCtx(timeoutMs)
	defer cancel()
	hs, err := h.co.Handshake(ctx)
	if errors.Is(err, wire.ErrHandshakePending) {
		return statusOK // not yet: call again
	}
	if err != nil {
		return finish(withCode(handshakeCode(err), err), errOut)
	}
	h.startMu.Lock()
	defer h.startMu.Unlock()
	switch {
	case h.closed:
		return finish(errorf(statusState, "kvbm_leader_wait_ready: leader freed"), errOut)
	case h.l == nil:
		o := h.opts
		o.BytesPerBlock, o.NumWorkers = hs.BytesPerBlock, hs.NumWorkers
		h.hs = hs
		if err := h.start(o, h.cfg, h.co); err != nil {
			return finish(err, errOut)
		}
	}
	*outReady = 1
	return statusOK
}

// workerMetrics is the metric set every worker of this process records
// into; the leader's endpoint serves its transfer families.
var workerMetrics = sync.OnceValue(metrics.New)

//export kvbm_leader_free
func kvbm_leader_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	freeHandle(hd, (*leaderHandle).interrupt, (*leaderHandle).close)
}

// interrupt runs when a free begins, before it waits for the calls in
// progress: a kvbm_leader_wait_ready still in the side channel's handshake
// returns (closing the channel ends it), and one that completed it does not
// start the leader.
func (h *leaderHandle) interrupt() {
	h.startMu.Lock()
	h.closed = true
	started := h.l != nil
	h.startMu.Unlock()
	if !started && h.co != nil {
		_ = h.co.Close()
	}
}

// leaderInfo is the JSON kvbm_leader_info returns (Python: LeaderInfo in
// python/kvbm/_core.py). The pointer fields are left out when nil.
type leaderInfo struct {
	HostBlocks         int                     `json:"host_blocks"`
	DiskBlocks         int                     `json:"disk_blocks"`
	DiskOnly           bool                    `json:"disk_only"`
	HostHitRate        float64                 `json:"host_hit_rate"`
	DiskHitRate        float64                 `json:"disk_hit_rate"`
	HostHitBlocks      int                     `json:"host_hit_blocks"`
	DiskHitBlocks      int                     `json:"disk_hit_blocks"`
	QueriedBlocks      int                     `json:"queried_blocks"`
	Degraded           bool                    `json:"degraded"`
	DeadRanks          []int                   `json:"dead_ranks"`
	BackgroundInflight int                     `json:"background_inflight"`
	HostBlocksUsed     int                     `json:"host_blocks_used"`
	DiskBlocksUsed     int                     `json:"disk_blocks_used"`
	MetricsAddr        *string                 `json:"metrics_addr,omitempty"` // when the metrics endpoint runs
	Consolidator       *leaderConsolidatorInfo `json:"consolidator,omitempty"` // when the leader runs one
	G4                 *leaderG4Info           `json:"g4,omitempty"`           // with the object-storage tier
	SideChannel        *leaderSideChannelInfo  `json:"side_channel,omitempty"` // with tensor-parallel ranks in other processes
}

// leaderConsolidatorInfo is leaderInfo's "consolidator" (Python: LeaderConsolidatorInfo).
type leaderConsolidatorInfo struct {
	EventsIn     uint64 `json:"events_in"`
	Deduplicated uint64 `json:"deduplicated"`
	ZMQEvents    uint64 `json:"zmq_events"`
	NATSEvents   uint64 `json:"nats_events"`
	NATSDropped  uint64 `json:"nats_dropped"`
	Tracked      int    `json:"tracked"`
	ZMQEndpoint  string `json:"zmq_endpoint"`
}

// leaderG4Info is leaderInfo's "g4" (Python: LeaderG4Info).
type leaderG4Info struct {
	OffloadBlocksH2Obj uint64 `json:"offload_blocks_h2obj"`
	OnboardBlocksObj2H uint64 `json:"onboard_blocks_obj2h"`
	LookupHits         uint64 `json:"lookup_hits"`
	LookupMisses       uint64 `json:"lookup_misses"`
	AlreadyStored      uint64 `json:"already_stored"`
	UploadDrops        uint64 `json:"upload_drops"`
	Errors             uint64 `json:"errors"`
	Corrupt            uint64 `json:"corrupt"`
	VerifyFailures     uint64 `json:"verify_failures"`
	QueueDepth         int64  `json:"queue_depth"`
	BreakersOpen       int64  `json:"breakers_open"`
}

// kvbm_leader_info returns JSON: host/disk block counts and the metrics address.
//
//export kvbm_leader_info
func kvbm_leader_info(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_leader_info", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	host, disk, hb, db, q := h.l.HitRates()
	info := leaderInfo{
		HostBlocks: h.l.NumHostBlocks(), DiskBlocks: h.l.NumDiskBlocks(), DiskOnly: h.l.DiskOnly(),
		HostHitRate: host, DiskHitRate: disk, HostHitBlocks: hb, DiskHitBlocks: db, QueriedBlocks: q,
	}
	degraded, dead := h.l.Degraded()
	if dead == nil {
		dead = []int{}
	}
	info.Degraded, info.DeadRanks, info.BackgroundInflight = degraded, dead, h.l.BackgroundInFlight()
	info.HostBlocksUsed, info.DiskBlocksUsed = h.l.BlocksUsed()
	if h.l.G4Enabled() {
		s := object.Snapshot()
		info.G4 = &leaderG4Info{
			OffloadBlocksH2Obj: s.Uploaded, OnboardBlocksObj2H: s.Downloaded,
			LookupHits: s.LookupHits, LookupMisses: s.LookupMisses, AlreadyStored: s.AlreadyStored,
			UploadDrops: s.Dropped, Errors: s.Errors, Corrupt: s.Corrupt, VerifyFailures: s.VerifyFailures,
			QueueDepth: s.QueueDepth, BreakersOpen: s.BreakersOpen,
		}
	}
	if h.metrics != nil {
		addr := h.metrics.Addr
		info.MetricsAddr = &addr
	}
	if h.co != nil {
		info.SideChannel = sideChannelInfo(h.co, h.hs, h.l)
	}
	if h.consolidator != nil {
		st := h.consolidator.Stats()
		info.Consolidator = &leaderConsolidatorInfo{
			EventsIn: st.EventsIn, Deduplicated: st.Deduplicated, ZMQEvents: st.ZMQEvents,
			NATSEvents: st.NATSEvents, NATSDropped: st.NATSDropped, Tracked: st.Tracked,
			ZMQEndpoint: h.consolidator.ZMQEndpoint(),
		}
	}
	b, _ := json.Marshal(info)
	cBuffer(b, out, outLen)
	return statusOK
}

// leaderOf resolves a live, ready leader handle and holds it until done
// (a free waits for the call; later calls fail as freed).
func leaderOf(hd C.uint64_t) (*leaderHandle, func(), error) {
	h, done, err := acquire[*leaderHandle](hd)
	if err != nil {
		return nil, done, err
	}
	if !h.ready.Load() {
		done()
		return nil, nop, errorf(statusState, "leader not ready: the side-channel handshake has not completed (kvbm_leader_wait_ready)")
	}
	return h, done, nil
}

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

// stepUpdate is one scheduled request, msgpack-encoded by the Python adapter
// as an array: [req_id, new_tokens, new_block_ids, num_computed,
// num_scheduled, priority, salt, resumed].
type stepUpdate struct {
	_msgpack     struct{} `msgpack:",as_array"`
	ReqID        string
	NewTokens    []uint32
	NewBlockIDs  []int64
	NumComputed  int
	NumScheduled int
	Priority     rowPriority
	Salt         uint64
	Resumed      bool
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

// stepInput is [updates, finished_loading_ids, load_error_blocks].
type stepInput struct {
	_msgpack   struct{} `msgpack:",as_array"`
	Updates    []stepUpdate
	Loaded     []string
	LoadErrors []int64
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
	ups := make([]leader.RequestUpdate, len(si.Updates))
	for i, u := range si.Updates {
		ups[i] = leader.RequestUpdate{
			ReqID: u.ReqID, NewTokens: u.NewTokens, NewBlockIDs: u.NewBlockIDs,
			NumComputedTokens: u.NumComputed, NumScheduledTokens: u.NumScheduled,
			Priorities: u.Priority.forBlocks(len(u.NewBlockIDs)), Salt: u.Salt, Resumed: u.Resumed,
		}
	}
	b, err := h.l.Step(ups)
	if err != nil {
		return finish(err, errOut)
	}
	cBuffer(b, out, outLen)
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
