// Package metrics holds kvbm's Prometheus metrics (SPEC §9 names, no labels,
// as the reference) and the optional /metrics HTTP endpoint.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics is one leader's (or worker's) set of metrics, registered in its own
// registry so that several instances in one process (tests) do not collide.
type Metrics struct {
	Registry *prometheus.Registry

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
	LoadErrors     prometheus.Counter
	BytesMoved     *prometheus.CounterVec // label: direction (d2h, h2d, ...)
	TransferSecs   *prometheus.HistogramVec

	// Consolidator.
	EventsIn      prometheus.Counter
	EventsOut     prometheus.Counter
	EventsDeduped prometheus.Counter
	EventsDropped prometheus.Counter
	EventsInvalid prometheus.Counter
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
		LoadErrors:     c("kvbm_load_errors", "Block loads that failed or did not verify (recomputed by the engine)"),
		BytesMoved: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_transfer_bytes", Help: "Bytes moved between tiers"}, []string{"direction"}),
		TransferSecs: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbm_transfer_seconds", Help: "Latency of one transfer batch",
			Buckets: prometheus.ExponentialBuckets(1e-5, 4, 10)}, []string{"direction"}),
		EventsIn:      c("kvbm_consolidator_events_in", "Block events received by the consolidator"),
		EventsOut:     c("kvbm_consolidator_events_out", "Block events published by the consolidator"),
		EventsDeduped: c("kvbm_consolidator_events_deduplicated", "Block events absorbed by deduplication"),
		EventsDropped: c("kvbm_consolidator_events_dropped", "Block events dropped (buffer full while a publisher was down)"),
		EventsInvalid: c("kvbm_consolidator_events_invalid", "Malformed input events skipped"),
		EventQueue:    g("kvbm_consolidator_queue_depth", "Events waiting to be published"),
	}
	r.MustRegister(m.BytesMoved, m.TransferSecs)
	return m
}

// Server serves /metrics until Close.
type Server struct {
	srv  *http.Server
	Addr string // the address actually bound (useful with port 0)
}

// Serve starts the Prometheus endpoint on addr (e.g. "0.0.0.0:6880").
func (m *Metrics) Serve(addr string) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics endpoint %s (set DYN_KVBM_METRICS_PORT to a free port): %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, Addr: ln.Addr().String()}
	go func() {
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
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
