package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"

	"github.com/kvbm/kvbm/goext/object"
)

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
	if h.n.Server != nil {
		addr := h.n.Server.Addr
		info.MetricsAddr = &addr
	}
	if h.co != nil {
		info.SideChannel = sideChannelInfo(h.co, h.hs, h.l)
	}
	if c := h.n.Consolidator; c != nil {
		st := c.Stats()
		info.Consolidator = &leaderConsolidatorInfo{
			EventsIn: st.EventsIn, Deduplicated: st.Deduplicated, ZMQEvents: st.ZMQEvents,
			NATSEvents: st.NATSEvents, NATSDropped: st.NATSDropped, Tracked: st.Tracked,
			ZMQEndpoint: c.ZMQEndpoint(),
		}
	}
	h.publishFigures()
	b, _ := json.Marshal(info)
	cBuffer(b, out, outLen)
	return statusOK
}
