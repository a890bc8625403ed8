package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"context"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/node"
	"github.com/kvbm/kvbm/goext/wire"
)

// The leader⇄worker side channel (goext/wire) for engines with several
// tensor-parallel ranks, converted from the "side_channel" object of the
// kvbm_leader_new and kvbm_worker_new options. The leader drives it itself
// (goext/leader sidechannel.go); a worker's side channel runs operations
// straight into its worker.Run (wire.RunOn).

// leaderSideChannelOptions is kvbm_leader_new's "side_channel" (Python:
// LeaderSideChannelOptions in python/kvbm/_core.py).
type leaderSideChannelOptions struct {
	// Transport: "auto" (in-process for one worker), "tcp" or "inproc".
	Transport string `json:"transport"`
	// Heartbeat tuning; 0: defaults (500 ms pings; suspected after
	// DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS of silence).
	PingIntervalMs int64 `json:"ping_interval_ms"`
	SuspectAfterMs int64 `json:"suspect_after_ms"`
	// Secret authenticates the side channel (the engine instance's id);
	// DYN_KVBM_LEADER_WORKER_SECRET, when set, is used instead.
	Secret string `json:"secret"`
	// BroadcastTimeoutMs bounds one background operation; 0: 60 s.
	BroadcastTimeoutMs int64 `json:"broadcast_timeout_ms"`
}

// workerSideChannelOptions is kvbm_worker_new's "side_channel" (Python:
// WorkerSideChannelOptions).
type workerSideChannelOptions struct {
	Transport string `json:"transport"`
	Secret    string `json:"secret"` // as in leaderSideChannelOptions
}

func ms(v int64) time.Duration { return time.Duration(v) * time.Millisecond }

// timeoutCtx is ctx bounded by timeoutMs (≤ 0: no bound beyond the callee's own).
func timeoutCtx(timeoutMs C.int64_t) (context.Context, context.CancelFunc) {
	if timeoutMs <= 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), ms(int64(timeoutMs)))
}

// listenSideChannel binds the leader's end for numWorkers ranks.
func listenSideChannel(o *leaderSideChannelOptions, cfg *config.Config, numWorkers int) (*wire.Coordinator, error) {
	return node.ListenSideChannel(cfg, node.LeaderSideChannel{Transport: o.Transport, PingInterval: ms(o.PingIntervalMs),
		SuspectAfter: ms(o.SuspectAfterMs), Secret: o.Secret}, numWorkers, nodeDeps())
}

// handshakeCode is the status of a failed handshake.
func handshakeCode(err error) int { return kindCode(node.HandshakeKind(err)) }

// leaderSideChannelInfo is leaderInfo's "side_channel" (Python:
// LeaderSideChannelInfo): the channel's state and the background loop's counters.
type leaderSideChannelInfo struct {
	Transport       string `json:"transport"`
	PubPort         int    `json:"pub_port"`
	AckPort         int    `json:"ack_port"`
	Healthy         bool   `json:"healthy"`
	DeadRanks       []int  `json:"dead_ranks"`    // processes gone, for good
	SuspectRanks    []int  `json:"suspect_ranks"` // silent; re-admitted when they answer again
	ForgedMessages  uint64 `json:"forged_messages"`
	NumDeviceBlocks int    `json:"num_device_blocks"` // as every rank reported in the handshake
	BytesPerBlock   int64  `json:"bytes_per_block"`   // one rank's share of a block
	Committed       uint64 `json:"committed"`
	Failed          uint64 `json:"failed"`
	LastError       string `json:"last_error"`

	// UnauthenticatedPeersDropped: connections to the ack port closed for
	// sending more than a few KiB before authenticating (goext/wire gate.go).
	UnauthenticatedPeersDropped uint64 `json:"unauthenticated_peers_dropped"`
}

func sideChannelInfo(co *wire.Coordinator, hs wire.Handshake, l *leader.Leader) *leaderSideChannelInfo {
	ep := co.Endpoint()
	st, _ := l.SideChannelStats()
	return &leaderSideChannelInfo{
		Transport: co.Transport().String(), PubPort: ep.PubPort, AckPort: ep.AckPort,
		Healthy: co.Healthy(), DeadRanks: nonNil(co.DeadRanks()), SuspectRanks: nonNil(co.SuspectRanks()),
		ForgedMessages: co.Forged(), NumDeviceBlocks: hs.NumDeviceBlocks, BytesPerBlock: hs.BytesPerBlock,
		Committed: st.Committed, Failed: st.Failed, LastError: st.LastError,
		UnauthenticatedPeersDropped: co.UnauthenticatedPeers().Dropped,
	}
}

// workerSideChannelInfo is workerInfo's "side_channel" (Python: WorkerSideChannelInfo).
type workerSideChannelInfo struct {
	Ready          bool   `json:"ready"` // the leader's handshake completed for this rank
	Stopped        bool   `json:"stopped"`
	Error          string `json:"error"` // "" while healthy
	ForgedMessages uint64 `json:"forged_messages"`
	Reconnects     uint64 `json:"reconnects"` // subscriptions redialed after the leader's side channel dropped or went silent

	// UnauthenticatedPeersDropped: subscriptions closed because the other
	// end sent too much before authenticating as the leader (goext/wire gate.go).
	UnauthenticatedPeersDropped uint64 `json:"unauthenticated_peers_dropped"`
}

func memberInfo(m *wire.Member) *workerSideChannelInfo {
	info := &workerSideChannelInfo{Ready: isClosed(m.Ready()), Stopped: isClosed(m.Done()),
		ForgedMessages: m.Forged(), Reconnects: m.Reconnects(), UnauthenticatedPeersDropped: m.UnauthenticatedPeers().Dropped}
	if e := m.Err(); e != nil {
		info.Error = e.Error()
	}
	return info
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// nonNil makes an empty list encode as [] rather than null.
func nonNil(r []int) []int {
	if r == nil {
		return []int{}
	}
	return r
}
