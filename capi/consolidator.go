package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"

	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/node"
)

// consolidatorOptions configures the KV event consolidator, either started by
// a leader (fed the leader's G2/G3 events in-process) or standalone.
type consolidatorOptions struct {
	Engine         string `json:"engine"`          // "vllm", "trtllm" or "sglang"
	EngineEndpoint string `json:"engine_endpoint"` // engine KV events (ZMQ SUB connects here); "" = none
	ZMQBind        string `json:"zmq_bind"`        // consolidated output (ZMQ PUB binds here); "" = none
	NATS           bool   `json:"nats"`            // publish RouterEvents on NATS (NATS_SERVER or nats_url)
	NATSURL        string `json:"nats_url"`
	Namespace      string `json:"namespace"`
	Component      string `json:"component"`
	LegacySubject  bool   `json:"legacy_subject"`
	WorkerID       uint64 `json:"worker_id"`
	BufferLimit    int    `json:"buffer_limit"`
	// Mode is "dedup" or "passthrough"; "": DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE.
	Mode string `json:"mode"`
	// Env holds kvbm's variables as the caller sees them (standalone use).
	Env map[string]string `json:"env"`
}

// spec is the assembly's view of the options.
func (o *consolidatorOptions) spec() *node.ConsolidatorSpec {
	return &node.ConsolidatorSpec{Engine: o.Engine, EngineEndpoint: o.EngineEndpoint, ZMQBind: o.ZMQBind, NATS: o.NATS,
		NATSURL: o.NATSURL, Namespace: o.Namespace, Component: o.Component, LegacySubject: o.LegacySubject,
		WorkerID: o.WorkerID, BufferLimit: o.BufferLimit, Mode: o.Mode}
}

type consolidatorHandle struct {
	lifetime
	c *consolidator.Consolidator
	m *metrics.Metrics
}

// kvbm_consolidator_new starts a standalone consolidator (no leader): engine
// events in, consolidated events out.
//
//export kvbm_consolidator_new
func kvbm_consolidator_new(optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_consolidator_new", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var o consolidatorOptions
	if err := parseOptions("kvbm_consolidator_new", optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	cfg, err := configFor(o.Env, false)
	if err != nil {
		return finish(err, errOut)
	}
	m := metrics.New()
	c, err := node.NewConsolidator(cfg, *o.spec(), m, kvbmLogger())
	if err != nil {
		return finish(err, errOut)
	}
	*out = newHandle(&consolidatorHandle{c: c, m: m})
	return statusOK
}

// consolidatorStats is the JSON kvbm_consolidator_stats returns (Python:
// ConsolidatorStats in python/kvbm/_core.py).
type consolidatorStats struct {
	BatchesIn      uint64 `json:"batches_in"`
	EventsIn       uint64 `json:"events_in"`
	Invalid        uint64 `json:"invalid"`
	Deduplicated   uint64 `json:"deduplicated"`
	UnknownRemoves uint64 `json:"unknown_removes"`
	NotForwarded   uint64 `json:"not_forwarded"`
	Tracked        int    `json:"tracked"`
	ZMQMessages    uint64 `json:"zmq_messages"`
	ZMQEvents      uint64 `json:"zmq_events"`
	NATSEvents     uint64 `json:"nats_events"`
	NATSDropped    uint64 `json:"nats_dropped"`
	NATSBuffered   int    `json:"nats_buffered"`
	ZMQEndpoint    string `json:"zmq_endpoint"`
}

// kvbm_consolidator_stats returns the consolidator's counters as JSON.
//
//export kvbm_consolidator_stats
func kvbm_consolidator_stats(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := acquire[*consolidatorHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_consolidator_stats", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	st := h.c.Stats()
	b, _ := json.Marshal(consolidatorStats{
		BatchesIn: st.BatchesIn, EventsIn: st.EventsIn, Invalid: st.Invalid,
		Deduplicated: st.Deduplicated, UnknownRemoves: st.UnknownRemoves, NotForwarded: st.NotForwarded,
		Tracked:     st.Tracked,
		ZMQMessages: st.ZMQMessages, ZMQEvents: st.ZMQEvents, NATSEvents: st.NATSEvents,
		NATSDropped: st.NATSDropped, NATSBuffered: st.NATSBuffered, ZMQEndpoint: h.c.ZMQEndpoint(),
	})
	cBuffer(b, out, outLen)
	return statusOK
}

//export kvbm_consolidator_free
func kvbm_consolidator_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	freeHandle(hd, nil, func(h *consolidatorHandle) { _ = h.c.Close() })
}
