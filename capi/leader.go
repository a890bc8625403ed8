package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/node"
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
	// KVGroups: the engine's KV cache groups when its plans carry group
	// rows (leader.Options.Groups); the step rows then carry each group's
	// blocks.
	KVGroups *kvGroupsOption `json:"kv_groups,omitempty"`
}

type kvGroupsOption struct {
	Primary   int      `json:"primary"`
	Windows   [][2]int `json:"windows"`
	NullBlock int64    `json:"null_block"`
	// State marks the groups of recurrent state (vLLM's MambaSpec).
	State []bool `json:"state,omitempty"`
}

type leaderHandle struct {
	lifetime
	// l is set once, by kvbm_leader_new or (with a side channel) the
	// kvbm_leader_wait_ready that completed the handshake, before ready;
	// n is what it was built with (goext/node).
	l     *leader.Leader
	n     *node.Leader
	ready atomic.Bool
	m     *metrics.Metrics
	once  sync.Once
	figs  figureSlots // figures.go

	// With a side channel: the channel, the options the leader is created
	// with once the handshake completed, and its outcome. startMu orders
	// that creation with close.
	co      *wire.Coordinator
	opts    leaderOptions
	hs      wire.Handshake
	startMu sync.Mutex
	closed  bool

	cfg *config.Config
}

func (h *leaderHandle) close() {
	h.once.Do(func() {
		h.startMu.Lock()
		h.closed = true
		n := h.n
		h.startMu.Unlock()
		// The leader first (node.Leader.Close: its background loop cancels
		// the operation in flight and stops using the side channel), then
		// what fed it, then the channel.
		if n != nil {
			n.Close()
		}
		if h.co != nil {
			_ = h.co.Close()
		}
	})
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

	h := &leaderHandle{m: metrics.New(), cfg: cfg, opts: o, figs: newFigureSlots(leaderFigureSlots)}
	h.figs.word(figStepNeeded).Store(1) // until the leader runs: every step goes to it
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

// start creates the leader and what it feeds (node.NewLeader); bc is its
// side channel, nil without one. On error everything started is released.
func (h *leaderHandle) start(o leaderOptions, cfg *config.Config, bc leader.Broadcaster) error {
	spec := node.LeaderSpec{
		BlockSize: o.BlockSize, BytesPerBlock: o.BytesPerBlock, NumWorkers: o.NumWorkers, WorkerID: o.WorkerID,
		Background: o.Background, SideChannel: bc, BroadcastTimeout: sideChannelTimeout(o.SideChannel),
		Fingerprint: o.Fingerprint, G4Async: o.G4Async, LoadFullHit: o.LoadFullHit, TierEvents: o.TierEvents,
		Metrics: h.m,
	}
	if g := o.KVGroups; g != nil {
		spec.Groups = &leader.Groups{Primary: g.Primary, Windows: g.Windows, NullBlock: g.NullBlock, State: g.State}
	}
	if c := o.Consolidator; c != nil {
		spec.Consolidator = c.spec()
	}
	n, err := node.NewLeader(cfg, spec, nodeDeps())
	if err != nil {
		return err
	}
	h.n, h.l = n, n.L
	if h.figs.p != nil {
		h.l.PublishStepNeeded(h.figs.word(figStepNeeded))
	}
	h.publishFigures()
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
