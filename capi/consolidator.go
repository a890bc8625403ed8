package main

import (
	"log/slog"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
)

// consolidatorOptions configures the KV event consolidator started by a leader.
type consolidatorOptions struct {
	EngineEndpoint string `json:"engine_endpoint"` // engine KV events (ZMQ SUB connects here)
	Engine         string `json:"engine"`          // "vllm" or "trtllm"
	ZMQBind        string `json:"zmq_bind"`        // consolidated output (ZMQ PUB binds here); "" = none
	NATS           bool   `json:"nats"`            // publish RouterEvents on NATS
	Namespace      string `json:"namespace"`
	Component      string `json:"component"`
	WorkerID       uint64 `json:"worker_id"`
}

// startConsolidator is wired once goext/consolidator lands.
func startConsolidator(o *consolidatorOptions, cfg *config.Config, m *metrics.Metrics, log *slog.Logger) (closer, events.Sink, error) {
	return nil, events.NopSink{}, errorf(statusState, "consolidator not available in this build")
}
