package node

import (
	"fmt"
	"log/slog"
	"strings"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/metrics"
)

// ConsolidatorSpec configures the KV event consolidator, either started by
// a leader (fed the leader's G2/G3 events in-process) or standalone.
type ConsolidatorSpec struct {
	Engine         string // "vllm" (or ""), "trtllm" or "sglang"
	EngineEndpoint string // engine KV events (ZMQ SUB connects here); "" = none
	ZMQBind        string // consolidated output (ZMQ PUB binds here); "" = none
	NATS           bool   // publish RouterEvents on NATS (NATSURL, else NATS_SERVER)
	NATSURL        string
	Namespace      string
	Component      string
	LegacySubject  bool
	WorkerID       uint64
	BufferLimit    int
	// Mode is "dedup" or "passthrough"; "": DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE.
	Mode string
}

// NewConsolidator starts a consolidator from cfg and spec, recording into m.
func NewConsolidator(cfg *config.Config, spec ConsolidatorSpec, m *metrics.Metrics, log *slog.Logger) (*consolidator.Consolidator, error) {
	if log == nil {
		log = slog.Default()
	}
	mode := spec.Mode
	if mode == "" {
		mode = cfg.ConsolidatorMode
	}
	cc := consolidator.Config{
		Mode:          consolidator.Mode(mode),
		ZMQBind:       spec.ZMQBind,
		WorkerID:      spec.WorkerID,
		BufferLimit:   spec.BufferLimit,
		LegacySubject: spec.LegacySubject,
		Logger:        log,
		Metrics:       m,
		// 0: consolidator.DefaultMaxTrackedBlocks.
		MaxTrackedBlocks: cfg.ConsolidatorMaxBlocks,
	}
	switch strings.ToLower(spec.Engine) {
	case "", "vllm":
		cc.Engine = consolidator.EngineVllm
	case "sglang":
		cc.Engine = consolidator.EngineSglang
	case "trtllm", "tensorrt_llm":
		cc.Engine = consolidator.EngineTrtllm
	default:
		// errprefix: the message names the component the engine configures, as before the assembly moved here
		return nil, withKind(KindInvalid, fmt.Errorf("consolidator: unknown engine %q (want vllm, trtllm or sglang)", spec.Engine))
	}
	if spec.EngineEndpoint != "" {
		cc.EngineEndpoints = []string{spec.EngineEndpoint}
	}
	if spec.NATS {
		cc.NATSURL = spec.NATSURL
		if cc.NATSURL == "" {
			cc.NATSURL = cfg.NatsServer
		}
		// "": the consolidator's defaults for the engine.
		cc.Namespace, cc.Component = spec.Namespace, spec.Component
	}
	c, err := consolidator.New(cc)
	if err != nil {
		if cc.Mode != consolidator.ModeDedup && cc.Mode != consolidator.ModePassthrough {
			return nil, withKind(KindInvalid, err)
		}
		return nil, withKind(KindIO, err)
	}
	log.Info("kvbm consolidator started", "engine", cc.Engine, "mode", mode, "input", spec.EngineEndpoint,
		"zmq_out", c.ZMQEndpoint(), "nats", cc.NATSURL, "nats_subject", c.NATSSubject())
	return c, nil
}
