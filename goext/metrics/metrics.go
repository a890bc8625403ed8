// Package metrics holds kvbm's Prometheus metrics (design §9 names, no labels,
// as the reference) and the optional /metrics HTTP endpoint.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// Metrics is one leader's (or worker's) set of metrics, registered in its own
// registry so that several instances in one process (tests) do not collide.
type Metrics struct {
	Registry *prometheus.Registry
	// Also is gathered with Registry on the endpoint when set: the
	// transfer families of the workers that share this process
	// (Families), whose sets are their own.
	Also prometheus.Gatherer

	OffloadD2H    prometheus.Counter // G1 → G2 blocks
	OffloadH2D    prometheus.Counter // G2 → G3 blocks
	OffloadD2D    prometheus.Counter // G1 → G3 blocks (disk-only mode)
	OnboardH2D    prometheus.Counter // G2 → G1 blocks
	OnboardD2D    prometheus.Counter // G3 → G1 blocks
	MatchedTokens prometheus.Counter

	HostHitRate prometheus.Gauge
	DiskHitRate prometheus.Gauge

	HostBlocksUsed prometheus.Gauge
	DiskBlocksUsed prometheus.Gauge
	BlockBytes     prometheus.Gauge // one block, all ranks: blocks/s × this = bytes/s
	LoadErrors     prometheus.Counter
	BytesMoved     *prometheus.CounterVec // label: direction (d2h, h2d, ...)
	TransferSecs   *prometheus.HistogramVec

	// Lifecycle (leader): purges served, and what purges and expiry
	// removed per tier (label tier: g2, g3 blocks; g4 objects, one per
	// rank and block).
	Purges        prometheus.Counter
	PurgedBlocks  *prometheus.CounterVec
	ExpiredBlocks *prometheus.CounterVec

	// Consolidator.
	EventsIn      prometheus.Counter
	EventsOut     prometheus.Counter
	EventsDeduped prometheus.Counter
	EventsDropped prometheus.Counter
	EventsInvalid prometheus.Counter
	BlocksEvicted prometheus.Counter // tracked blocks forgotten at the tracker's cap
	EventQueue    prometheus.Gauge
}

// New creates and registers every metric.
func New() *Metrics {
	r := prometheus.NewRegistry()
	c := func(name, help string) prometheus.Counter {
		x := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
		r.MustRegister(x)
		return x
	}
	g := func(name, help string) prometheus.Gauge {
		x := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
		r.MustRegister(x)
		return x
	}
	m := &Metrics{
		Registry:       r,
		OffloadD2H:     c("kvbm_offload_blocks_d2h", "Blocks offloaded from device (G1) to host (G2)"),
		OffloadH2D:     c("kvbm_offload_blocks_h2d", "Blocks offloaded from host (G2) to disk (G3)"),
		OffloadD2D:     c("kvbm_offload_blocks_d2d", "Blocks offloaded from device (G1) directly to disk (G3)"),
		OnboardH2D:     c("kvbm_onboard_blocks_h2d", "Blocks onboarded from host (G2) to device (G1)"),
		OnboardD2D:     c("kvbm_onboard_blocks_d2d", "Blocks onboarded from disk (G3) to device (G1)"),
		MatchedTokens:  c("kvbm_matched_tokens", "Prompt tokens matched in kvbm tiers"),
		HostHitRate:    g("kvbm_host_cache_hit_rate", "Host (G2) hit rate over recent requests, 0..1"),
		DiskHitRate:    g("kvbm_disk_cache_hit_rate", "Disk (G3) hit rate over recent requests, 0..1"),
		HostBlocksUsed: g("kvbm_host_blocks_registered", "Registered blocks in the host tier"),
		DiskBlocksUsed: g("kvbm_disk_blocks_registered", "Registered blocks in the disk tier"),
		BlockBytes:     g("kvbm_block_bytes", "Bytes of one KV block across all tensor-parallel ranks (block counters × this = bytes)"),
		LoadErrors:     c("kvbm_load_errors", "Block loads that failed or did not verify (recomputed by the engine)"),
		BytesMoved: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_transfer_bytes", Help: "Bytes moved between tiers"}, []string{"direction"}),
		TransferSecs: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbm_transfer_seconds", Help: "Latency of one transfer batch",
			Buckets: prometheus.ExponentialBuckets(1e-5, 4, 10)}, []string{"direction"}),
		Purges: c("kvbm_purges", "Purge requests served (python -m kvbm purge, kvbm.admin.purge)"),
		PurgedBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_purged_blocks", Help: "Blocks removed by purges, per tier (g2, g3: blocks; g4: objects deleted, one per rank)"},
			[]string{"tier"}),
		ExpiredBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_expired_blocks", Help: "Blocks removed by expiry, per tier (g3: DYN_KVBM_DISK_TTL_SECS; g4: objects, DYN_KVBM_OBJECT_TTL_SECS)"},
			[]string{"tier"}),
		EventsIn:      c("kvbm_consolidator_events_in", "Block events received by the consolidator"),
		EventsOut:     c("kvbm_consolidator_events_out", "Block events published by the consolidator"),
		EventsDeduped: c("kvbm_consolidator_events_deduplicated", "Block events absorbed by deduplication"),
		EventsDropped: c("kvbm_consolidator_events_dropped", "Block events dropped (buffer full while a publisher was down)"),
		EventsInvalid: c("kvbm_consolidator_events_invalid", "Malformed input events skipped"),
		BlocksEvicted: c("kvbm_consolidator_blocks_evicted", "Tracked blocks forgotten (and removed for the router) at the tracking cap"),
		EventQueue:    g("kvbm_consolidator_queue_depth", "Events waiting to be published"),
	}
	r.MustRegister(m.BytesMoved, m.TransferSecs, m.PurgedBlocks, m.ExpiredBlocks)
	registerZMQGuard(r)
	return m
}

// registerZMQGuard exports the process-wide counts of ZeroMQ peers that
// goext/zmqguard turned away.
func registerZMQGuard(r *prometheus.Registry) {
	for _, x := range []struct {
		name, help string
		get        func(zmqguard.Stats) uint64
	}{
		{"kvbm_zmq_handshakes_refused", "ZeroMQ peers whose handshake was invalid, too slow, or over the pending limit",
			func(s zmqguard.Stats) uint64 { return s.HandshakeFailures }},
		{"kvbm_zmq_oversized_messages", "ZeroMQ peers disconnected for declaring a message over the size limit",
			func(s zmqguard.Stats) uint64 { return s.OversizedMessages }},
		{"kvbm_zmq_slow_peers_dropped", "ZeroMQ peers disconnected for not taking a write in time (e.g. a subscriber that stopped reading)",
			func(s zmqguard.Stats) uint64 { return s.SlowPeersDropped }},
		{"kvbm_zmq_subscribers_dropped", "ZeroMQ subscribers disconnected for subscribing past the topic count or topic bytes cap",
			func(s zmqguard.Stats) uint64 { return s.SubscribersDropped }},
	} {
		r.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: x.name, Help: x.help},
			func() float64 { return float64(x.get(zmqguard.Default().Stats())) }))
	}
}

// ServerOptions bound what clients can hold of the /metrics endpoint, so
// that idle or slow connections cannot exhaust the process's file
// descriptors (the engine shares them). Zero fields take the Default values.
type ServerOptions struct {
	// MaxConns bounds the connections held at once; a connection beyond it
	// is closed as soon as it is accepted.
	MaxConns int
	// ReadHeaderTimeout bounds how long a connection may take to send its
	// request headers, from accept on: an idle or trickling connection is
	// closed when it expires.
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration // the whole request
	WriteTimeout      time.Duration // the whole response
	IdleTimeout       time.Duration // a kept-alive connection between requests
	// ScrapesPerSecond and ScrapeBurst are each client's token bucket
	// (clientLimiter): a request beyond it is answered 429.
	ScrapesPerSecond float64
	ScrapeBurst      int
}

// Defaults of ServerOptions (those of the DYN_KVBM_METRICS_* variables). A
// scrape is one small request every few seconds; a handful of scrapers need
// far fewer connections than MaxConns.
const (
	DefaultMaxConns          = config.DefaultMetricsMaxConnections
	DefaultReadHeaderTimeout = config.DefaultMetricsReadHeaderTimeout
	DefaultReadTimeout       = config.DefaultMetricsReadTimeout
	DefaultWriteTimeout      = config.DefaultMetricsWriteTimeout
	DefaultIdleTimeout       = config.DefaultMetricsIdleTimeout
)

// ServerOptionsFrom takes the endpoint's bounds from kvbm's configuration
// (DYN_KVBM_METRICS_MAX_CONNECTIONS and the _TIMEOUT_SECS variables).
func ServerOptionsFrom(c *config.Config) ServerOptions {
	return ServerOptions{
		MaxConns:          c.MetricsMaxConnections,
		ReadHeaderTimeout: c.MetricsReadHeaderTimeout,
		ReadTimeout:       c.MetricsReadTimeout,
		WriteTimeout:      c.MetricsWriteTimeout,
		IdleTimeout:       c.MetricsIdleTimeout,
	}
}

func (o *ServerOptions) fill() {
	set := func(d *time.Duration, def time.Duration) {
		if *d <= 0 {
			*d = def
		}
	}
	if o.MaxConns <= 0 {
		o.MaxConns = DefaultMaxConns
	}
	set(&o.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	set(&o.ReadTimeout, DefaultReadTimeout)
	set(&o.WriteTimeout, DefaultWriteTimeout)
	set(&o.IdleTimeout, DefaultIdleTimeout)
	if o.ScrapesPerSecond <= 0 {
		o.ScrapesPerSecond = DefaultScrapesPerSecond
	}
	if o.ScrapeBurst <= 0 {
		o.ScrapeBurst = DefaultScrapeBurst
	}
}

// Server serves /metrics until Close.
type Server struct {
	srv  *http.Server
	Addr string // the address actually bound (useful with port 0)
}

// Serve starts the Prometheus endpoint on addr (e.g. "127.0.0.1:6880") with
// the default ServerOptions.
func (m *Metrics) Serve(addr string) (*Server, error) {
	return m.ServeWith(addr, ServerOptions{})
}

// ServeWith starts the Prometheus endpoint on addr. Its goroutine (the
// http.Server's accept loop) is owned by the Server and ends at Close.
func (m *Metrics) ServeWith(addr string, o ServerOptions) (*Server, error) {
	o.fill()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: endpoint %s (%s must be an address of this host, %s a free port): %w",
			addr, config.EnvMetricsHost, config.EnvMetricsPort, err)
	}
	mux := http.NewServeMux()
	g := prometheus.Gatherers{m.Registry}
	if m.Also != nil {
		g = append(g, m.Also)
	}
	lim := newClientLimiter(o.ScrapesPerSecond, o.ScrapeBurst)
	mux.Handle("/metrics", lim.wrap(promhttp.HandlerFor(g, promhttp.HandlerOpts{})))
	s := &Server{
		srv: &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: o.ReadHeaderTimeout,
			ReadTimeout:       o.ReadTimeout,
			WriteTimeout:      o.WriteTimeout,
			IdleTimeout:       o.IdleTimeout,
			ErrorLog:          log.New(io.Discard, "", 0), // a flood must not flood the logs
		},
		Addr: ln.Addr().String(),
	}
	go func() {
		if err := s.srv.Serve(newConnLimiter(ln, o.MaxConns)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			_ = err // the listener is gone; nothing left to serve
		}
	}()
	return s, nil
}

// Close stops the endpoint.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return s.srv.Shutdown(ctx)
}

// Families is a Gatherer of only the named metric families of m: another
// set's endpoint can serve them (Metrics.Also) without duplicating the
// families both sets have.
func (m *Metrics) Families(names ...string) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		all, err := m.Registry.Gather()
		out := all[:0]
		for _, mf := range all {
			if slices.Contains(names, mf.GetName()) {
				out = append(out, mf)
			}
		}
		return out, err
	})
}
