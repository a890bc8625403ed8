package consolidator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/nats-io/nats.go"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// Defaults of Config.
const (
	DefaultBufferLimit  = 100_000
	DefaultReconnectMin = 100 * time.Millisecond // as the reference's ZMQ reconnect interval
	DefaultReconnectMax = 5 * time.Second
	// maxEventsPerMessage bounds one consolidated ZMQ message; a backlog is
	// sent as several messages so that no reader sees a huge allocation.
	maxEventsPerMessage = 1024
	// zmqHighWaterMark bounds the PUB socket's queue (messages): a stalled
	// subscriber must not grow our memory without limit.
	zmqHighWaterMark = 10_000
)

// Mode is what the consolidator does with the events it receives
// (DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE).
type Mode string

const (
	// ModeDedup (the default) merges the engine's events with kvbm's tier
	// events: one STORE per logical block, one REMOVE when no holder has
	// it any more (the tracker, design §7.2).
	ModeDedup Mode = "dedup"
	// ModePassthrough forwards the engine's events as they arrive, one
	// output event per block, under the engine's own hashes and parents,
	// and its AllBlocksCleared as a CLEAR; nothing is tracked. kvbm's tier
	// events are not forwarded (counted in Stats.NotForwarded): they name
	// blocks by kvbm's sequence hashes, not the engine's, so without the
	// tracker the router would index each offloaded prefix twice, under two
	// hashes, and one holder's eviction would REMOVE a block the other still
	// has. The router then sees exactly the engine's G1, as with no kvbm.
	ModePassthrough Mode = "passthrough"
)

// Modes lists the accepted modes, the default first.
var Modes = []Mode{ModeDedup, ModePassthrough}

// DefaultNamespace is the NATS subject namespace when Config.Namespace is
// empty (Dynamo's default namespace).
const DefaultNamespace = "dynamo"

// defaultComponent is the NATS subject component per engine when
// Config.Component is empty.
var defaultComponent = map[Engine]string{EngineVllm: "backend", EngineTrtllm: "tensorrt_llm", EngineSglang: "backend"}

// Config configures a Consolidator. At least one output (ZMQBind or
// NATSURL) is required; inputs are optional (kvbm's in-process events
// arrive through Publish).
type Config struct {
	// Engine names the engine source in logs (Vllm, Trtllm or Sglang);
	// with Sglang, the engine's host tier events (medium "CPU_PINNED") are
	// a holder of their own (sglang.go).
	Engine Engine
	// Mode is ModeDedup (default when empty) or ModePassthrough.
	Mode Mode
	// EngineEndpoints are the engine's KV event publishers to subscribe to
	// (ZMQ SUB, connect, all topics), e.g. "tcp://127.0.0.1:5557". A "*"
	// host is read as 127.0.0.1. Unreachable endpoints are retried with
	// backoff; the engine may start after the consolidator.
	EngineEndpoints []string
	// ZMQBind is the consolidated output (ZMQ PUB, bind), e.g.
	// "tcp://0.0.0.0:57001"; "*" is read as 0.0.0.0 and port 0 picks a free
	// port (see ZMQEndpoint). Empty: no ZMQ output.
	ZMQBind string
	// NATSURL enables RouterEvent JSON output to NATS (e.g.
	// "nats://localhost:4222", NATS_SERVER). Empty: no NATS output.
	NATSURL string
	// Namespace and Component name the NATS subject. Defaults: namespace
	// DefaultNamespace; component "tensorrt_llm" for TensorRT-LLM and
	// "backend" for vLLM, the components Dynamo's workers register.
	Namespace string
	Component string
	// LegacySubject publishes on the pre-2025-12 suffix "kv_events" instead
	// of "kv-events".
	LegacySubject bool
	WorkerID      uint64 // RouterEvent.worker_id
	// BufferLimit bounds the RouterEvents held while NATS is unreachable
	// (default DefaultBufferLimit); beyond it new events are dropped,
	// counted and logged.
	BufferLimit int
	// MaxTrackedBlocks caps the logical blocks the deduplication tracker
	// holds (default DefaultMaxTrackedBlocks); beyond it the oldest is
	// forgotten and a REMOVE of it published.
	MaxTrackedBlocks int
	// ReconnectMin/Max bound the exponential backoff of ZMQ and NATS
	// reconnects (defaults DefaultReconnectMin, DefaultReconnectMax).
	ReconnectMin, ReconnectMax time.Duration
	// NATSOptions are appended to ours (credentials, TLS, a custom dialer).
	NATSOptions []nats.Option
	Logger      *slog.Logger     // nil: discard
	Metrics     *metrics.Metrics // nil: none
}

// Stats is a snapshot of a Consolidator's counters.
type Stats struct {
	BatchesIn      uint64 // engine messages decoded
	EventsIn       uint64 // block events in (a stored/removed hash, a clear), engine and kvbm
	Invalid        uint64 // engine messages or events skipped as malformed
	Deduplicated   uint64 // stores/removes absorbed by deduplication
	UnknownRemoves uint64 // removes of untracked blocks (warned)
	Evicted        uint64 // tracked blocks forgotten at MaxTrackedBlocks (REMOVE published)
	NotForwarded   uint64 // kvbm tier events dropped in ModePassthrough; engine events of other tiers (engineTier)
	Tracked        int    // logical blocks tracked now
	ZMQMessages    uint64 // consolidated messages sent
	ZMQEvents      uint64 // consolidated events sent over ZMQ
	NATSEvents     uint64 // RouterEvents confirmed by the NATS server
	NATSDropped    uint64 // RouterEvents dropped (buffer full)
	NATSBuffered   int    // RouterEvents waiting for NATS
}

// Consolidator merges engine and kvbm KV events (design §7). It implements
// events.Sink for kvbm's in-process tier events.
//
// Goroutines, all owned by the Consolidator and stopped by Close:
//   - one subscriber per engine endpoint (subscribe), stopped by cancelling
//     ctx, which also unblocks its socket;
//   - the flusher (flushLoop), woken through wake whenever the tracker
//     queues events; stopped by closing stopFlush after the subscribers
//     have exited, so that it publishes their last events;
//   - the NATS sender (natsOut.run), stopped by natsOut.close after the
//     flusher.
type Consolidator struct {
	cfg Config
	log *slog.Logger
	m   *metrics.Metrics

	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex // guards the fields below until the blank line (input side)
	tr     *Tracker
	closed bool
	stats  Stats

	wake      chan struct{} // capacity 1: "the tracker has queued events"
	stopFlush chan struct{}
	subWG     sync.WaitGroup
	flushWG   sync.WaitGroup
	closeOnce sync.Once

	pub   zmq4.Socket // nil without ZMQ output; used by the flusher only
	pubEP string
	seq   uint64 // next ZMQ sequence number; flusher only
	// zmqOut's mutex guards its counters.
	zmqOut struct {
		sync.Mutex
		messages, events uint64
	}
	nats *natsOut // nil without NATS output
}

var _ events.Sink = (*Consolidator)(nil)

// New validates cfg, binds the ZMQ output, starts connecting to NATS and to
// the engine endpoints, and returns a running Consolidator. NATS or an
// engine being down is not an error (they are retried); a bad setting or a
// ZMQ bind failure is.
func New(cfg Config) (*Consolidator, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	c := &Consolidator{
		cfg:       cfg,
		log:       log,
		m:         cfg.Metrics,
		tr:        NewTracker(cfg.Engine, log, WithMaxBlocks(cfg.MaxTrackedBlocks)),
		wake:      make(chan struct{}, 1),
		stopFlush: make(chan struct{}),
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	log.Info(fmt.Sprintf("Starting KV Event Consolidator (mode %s): subscribe from %s, publish to ZMQ at %s, NATS at %s",
		cfg.Mode, orNone(strings.Join(cfg.EngineEndpoints, ", ")), orNone(cfg.ZMQBind), orNone(cfg.NATSURL)))

	if cfg.ZMQBind != "" {
		// kvbm's PUB (zmqguard.Pub): its Close ends its goroutines, and it
		// lives until Close, after the flusher has published the last
		// events (c.ctx is cancelled first, to stop the subscribers).
		pub := zmqguard.NewPub()
		if err := pub.SetOption(zmq4.OptionHWM, zmqHighWaterMark); err != nil {
			c.cancel()
			return nil, fmt.Errorf("consolidator: ZMQ output high-water mark: %w", err)
		}
		if err := pub.Listen(zmqguard.Endpoint(cfg.ZMQBind)); err != nil {
			_ = pub.Close()
			c.cancel()
			return nil, fmt.Errorf("consolidator: bind ZMQ output %s (DYN_KVBM_LEADER_ZMQ_PUB_PORT + 1000 must be free): %w",
				cfg.ZMQBind, err)
		}
		c.pub = pub
		c.pubEP = cfg.ZMQBind
		if a := pub.Addr(); a != nil {
			c.pubEP = a.Network() + "://" + a.String()
		}
		log.Info("Publisher bound to " + c.pubEP)
	}
	if cfg.NATSURL != "" {
		subject := events.Subject(cfg.Namespace, cfg.Component)
		if cfg.LegacySubject {
			subject = events.SubjectWithSuffix(cfg.Namespace, cfg.Component, events.LegacyKVEventSubject)
		}
		n, err := newNATSOut(&cfg, subject, c.m)
		if err != nil {
			if c.pub != nil {
				_ = c.pub.Close()
			}
			c.cancel()
			return nil, err
		}
		c.nats = n
	}

	c.flushWG.Add(1)
	go c.flushLoop()
	for _, ep := range cfg.EngineEndpoints {
		c.subWG.Add(1)
		go c.subscribe(ep)
	}
	log.Info("KV Event Consolidator fully started and ready")
	return c, nil
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// normalize fills defaults and validates; errors name the setting.
func (cfg *Config) normalize() error {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Engine != EngineVllm && cfg.Engine != EngineTrtllm && cfg.Engine != EngineSglang {
		return fmt.Errorf("consolidator: engine %d is not vLLM, TensorRT-LLM or SGLang", cfg.Engine)
	}
	switch cfg.Mode {
	case "":
		cfg.Mode = ModeDedup
	case ModeDedup, ModePassthrough:
	default:
		return fmt.Errorf("consolidator: mode %q (DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE): must be %s or %s",
			cfg.Mode, ModeDedup, ModePassthrough)
	}
	if cfg.ZMQBind == "" && cfg.NATSURL == "" {
		return errors.New("consolidator: no output configured (set the ZMQ output endpoint or NATS_SERVER)")
	}
	eps := make([]string, 0, len(cfg.EngineEndpoints))
	for _, ep := range cfg.EngineEndpoints {
		ep, err := normalizeEndpoint("engine KV events endpoint", ep, "127.0.0.1", false)
		if err != nil {
			return err
		}
		eps = append(eps, ep)
	}
	cfg.EngineEndpoints = eps
	if cfg.ZMQBind != "" {
		ep, err := normalizeEndpoint("consolidator output endpoint", cfg.ZMQBind, "0.0.0.0", true)
		if err != nil {
			return err
		}
		cfg.ZMQBind = ep
	}
	if cfg.NATSURL != "" {
		if cfg.Namespace == "" {
			cfg.Namespace = DefaultNamespace
		}
		if cfg.Component == "" {
			cfg.Component = defaultComponent[cfg.Engine]
		}
		if err := events.ValidateSubjectToken("NATS namespace", cfg.Namespace); err != nil {
			return fmt.Errorf("consolidator: %w", err)
		}
		if err := events.ValidateSubjectToken("NATS component", cfg.Component); err != nil {
			return fmt.Errorf("consolidator: %w", err)
		}
	}
	if cfg.BufferLimit < 0 {
		return fmt.Errorf("consolidator: buffer limit %d is negative", cfg.BufferLimit)
	}
	if cfg.BufferLimit == 0 {
		cfg.BufferLimit = DefaultBufferLimit
	}
	if cfg.MaxTrackedBlocks < 0 {
		return fmt.Errorf("consolidator: max tracked blocks %d is negative", cfg.MaxTrackedBlocks)
	}
	if cfg.ReconnectMin <= 0 {
		cfg.ReconnectMin = DefaultReconnectMin
	}
	if cfg.ReconnectMax < cfg.ReconnectMin {
		cfg.ReconnectMax = max(DefaultReconnectMax, cfg.ReconnectMin)
	}
	return nil
}

// normalizeEndpoint checks a ZMQ endpoint (tcp://host:port or ipc://path)
// and replaces a "*" host, which libzmq accepts but Go's net package does
// not, with star.
func normalizeEndpoint(what, ep, star string, bind bool) (string, error) {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok {
		return "", fmt.Errorf("consolidator: %s %q is not a ZMQ endpoint (want tcp://host:port or ipc://path)", what, ep)
	}
	switch scheme {
	case "ipc":
		if rest == "" {
			return "", fmt.Errorf("consolidator: %s %q has no path", what, ep)
		}
		return ep, nil
	case "tcp":
	default:
		return "", fmt.Errorf("consolidator: %s %q: unsupported transport %q (want tcp or ipc)", what, ep, scheme)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return "", fmt.Errorf("consolidator: %s %q: %w", what, ep, err)
	}
	p, err := strconv.Atoi(port)
	lo := 1
	if bind {
		lo = 0 // port 0: any free port (tests)
	}
	if err != nil || p < lo || p > 65535 {
		return "", fmt.Errorf("consolidator: %s %q: port %q is not in %d..65535", what, ep, port, lo)
	}
	if host == "*" || host == "" {
		host = star
	}
	return "tcp://" + net.JoinHostPort(host, port), nil
}

// ZMQEndpoint is the bound ZMQ output address (with the real port when
// ZMQBind asked for port 0); "" without ZMQ output.
func (c *Consolidator) ZMQEndpoint() string { return c.pubEP }

// NATSSubject is the subject RouterEvents are published on ("" without NATS
// output).
func (c *Consolidator) NATSSubject() string {
	if c.nats == nil {
		return ""
	}
	return c.nats.subject
}

// Publish implements events.Sink: it applies one kvbm tier event (Holder
// KvbmHost or KvbmDisk; the external hash is SeqHash, the parent Parent if
// HasParent) and wakes the flusher. It never blocks on I/O; after Close it
// does nothing.
func (c *Consolidator) Publish(ev events.BlockEvent) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	if c.cfg.Mode == ModePassthrough {
		c.stats.EventsIn++
		c.stats.NotForwarded++
		c.mu.Unlock()
		c.countIn(1)
		return
	}
	d0, u0 := c.tr.deduped, c.tr.unknownRemoves
	c.tr.ApplyKvbm(&ev)
	c.stats.EventsIn++
	c.noteTracker(d0, u0)
	queued := c.tr.Queued() > 0
	c.mu.Unlock()
	c.countIn(1)
	if queued {
		c.signal()
	}
}

// noteTracker moves the tracker's counters since (d0, u0) into stats and
// metrics. Caller holds c.mu.
func (c *Consolidator) noteTracker(d0, u0 uint64) {
	d := c.tr.deduped - d0
	c.stats.Deduplicated += d
	c.stats.UnknownRemoves += c.tr.unknownRemoves - u0
	if c.m != nil && d > 0 {
		c.m.EventsDeduped.Add(float64(d))
	}
	if e := c.tr.evicted - c.stats.Evicted; e > 0 {
		c.stats.Evicted = c.tr.evicted
		if c.m != nil {
			c.m.BlocksEvicted.Add(float64(e))
		}
	}
}

func (c *Consolidator) countIn(n int) {
	if c.m != nil && n > 0 {
		c.m.EventsIn.Add(float64(n))
	}
}

func (c *Consolidator) countInvalid(n int) {
	if c.m != nil && n > 0 {
		c.m.EventsInvalid.Add(float64(n))
	}
}

// signal wakes the flusher; a pending wake-up already covers new events.
func (c *Consolidator) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// applyBatch feeds one decoded engine batch to the tracker.
func (c *Consolidator) applyBatch(b *events.Batch) {
	n := 0
	for i := range b.Events {
		if k := b.Events[i].Kind; k == events.KindCleared {
			n++
		} else {
			n += len(b.Events[i].BlockHashes)
		}
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	d0, u0 := c.tr.deduped, c.tr.unknownRemoves
	for i := range b.Events {
		if !c.fromEngine(&b.Events[i]) {
			// Another tier's events in the engine's stream (kvbm's own G2/G3,
			// which arrive here in-process, or the engine's offloading).
			c.stats.NotForwarded += uint64(len(b.Events[i].BlockHashes))
			continue
		}
		if c.cfg.Mode == ModePassthrough {
			c.tr.Forward(&b.Events[i])
		} else {
			c.tr.ApplyEngine(&b.Events[i])
		}
	}
	c.stats.BatchesIn++
	c.stats.EventsIn += uint64(n)
	c.stats.Invalid += uint64(len(b.Skipped))
	c.noteTracker(d0, u0)
	queued := c.tr.Queued() > 0
	c.mu.Unlock()
	c.countIn(n)
	c.countInvalid(len(b.Skipped))
	if queued {
		c.signal()
	}
}

// flushLoop publishes whatever the tracker has queued as soon as it is
// woken: under load, events queued while a publish is in progress go out
// together in the next one, so batching grows with the load instead of
// waiting for a timer (the reference flushes every 50 ms).
func (c *Consolidator) flushLoop() {
	defer c.flushWG.Done()
	var buf []events.ConsolidatedEvent
	for {
		select {
		case <-c.wake:
			buf = c.flush(buf)
		case <-c.stopFlush:
			c.flush(buf) // what the last inputs queued
			return
		}
	}
}

// flush drains the tracker and publishes; it returns buf for reuse.
func (c *Consolidator) flush(buf []events.ConsolidatedEvent) []events.ConsolidatedEvent {
	c.mu.Lock()
	buf = c.tr.Drain(buf[:0])
	c.mu.Unlock()
	if len(buf) == 0 {
		return buf
	}
	c.log.Debug(fmt.Sprintf("Publishing %d consolidated event(s) to router", len(buf)))
	if c.pub != nil {
		c.sendZMQ(buf)
	}
	if c.nats != nil {
		c.nats.enqueue(buf)
	}
	if c.m != nil {
		c.m.EventQueue.Set(float64(c.queueDepth()))
	}
	clear(buf) // drop token slices for the GC; the backing array is reused
	return buf
}

func (c *Consolidator) queueDepth() int {
	n := 0
	if c.nats != nil {
		n = c.nats.buffered()
	}
	return n
}

// sendZMQ publishes evs as one or more consolidated messages.
func (c *Consolidator) sendZMQ(evs []events.ConsolidatedEvent) {
	for len(evs) > 0 {
		chunk := evs[:min(len(evs), maxEventsPerMessage)]
		evs = evs[len(chunk):]
		ts := float64(time.Now().UnixNano()) / 1e9
		frames := events.ZMQFrames(c.seq, events.EncodeZMQPayload(ts, chunk))
		// Counted before the send: a subscriber that has the message must
		// already see it in Stats and in the metrics.
		c.countZMQ(1, len(chunk))
		if err := c.pub.Send(zmq4.NewMsgFrom(frames...)); err != nil {
			// PUB sends only queue; an error means the socket is closing.
			c.countZMQ(-1, -len(chunk))
			c.log.Warn(fmt.Sprintf("Consolidator: failed to publish batch of %d event(s) to ZMQ (seq=%d): %v", len(chunk), c.seq, err))
			continue
		}
		c.log.Debug(fmt.Sprintf("Consolidator: Published batch with %d event(s) to ZMQ (seq=%d)", len(chunk), c.seq))
		c.seq++
	}
}

// countZMQ adds to the ZMQ output counters (negative: a send that failed).
func (c *Consolidator) countZMQ(messages, evs int) {
	c.zmqOut.Lock()
	c.zmqOut.messages += uint64(int64(messages))
	c.zmqOut.events += uint64(int64(evs))
	c.zmqOut.Unlock()
	if c.m != nil && evs > 0 {
		c.m.EventsOut.Add(float64(evs))
	}
}

// Stats returns a snapshot of the counters.
func (c *Consolidator) Stats() Stats {
	c.mu.Lock()
	s := c.stats
	s.Tracked = c.tr.Len()
	c.mu.Unlock()
	c.zmqOut.Lock()
	s.ZMQMessages, s.ZMQEvents = c.zmqOut.messages, c.zmqOut.events
	c.zmqOut.Unlock()
	if c.nats != nil {
		s.NATSEvents, s.NATSDropped, s.NATSBuffered = c.nats.counts()
	}
	return s
}

// Close stops every goroutine, publishes what the inputs had already
// queued (NATS: as far as it is reachable within a short grace period),
// and closes the sockets and the NATS connection. Publish calls after
// Close are ignored. Close is idempotent.
func (c *Consolidator) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closed = true
		c.mu.Unlock()
		c.cancel() // subscribers: sockets unblock, loops end
		c.subWG.Wait()
		close(c.stopFlush)
		c.flushWG.Wait()
		c.mu.Lock()
		c.tr.FlushWarnings()
		c.mu.Unlock()
		if c.nats != nil {
			c.nats.close()
		}
		if c.pub != nil {
			_ = c.pub.Close()
		}
		c.log.Info("KV Event Consolidator stopped")
	})
	return nil
}
