package leader

import (
	"bytes"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

const bs = 4 // block size of every test leader

type recSink struct{ evs []events.BlockEvent }

func (r *recSink) Publish(ev events.BlockEvent) { r.evs = append(r.evs, ev) }

func (r *recSink) take() []events.BlockEvent {
	evs := r.evs
	r.evs = nil
	return evs
}

type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time          { return c.t }
func (c *fakeClock) Advance(d time.Duration) { c.t = c.t.Add(d) }

type env struct {
	l     *Leader
	sink  *recSink
	m     *metrics.Metrics
	clock *fakeClock
	logs  *bytes.Buffer
}

// newEnv builds a leader with host/disk sizes given as block overrides
// (0 = tier off). mod adjusts the config before New.
func newEnv(t *testing.T, hostBlocks, diskBlocks int, mod func(*config.Config)) *env {
	t.Helper()
	return newEnvWith(t, hostBlocks, diskBlocks, mod, nil)
}

// newEnvWith is newEnv with opt adjusting the Options before New.
func newEnvWith(t *testing.T, hostBlocks, diskBlocks int, mod func(*config.Config), opt func(*Options)) *env {
	t.Helper()
	cfg := &config.Config{
		CPUCacheOverrideBlocks:  hostBlocks,
		DiskCacheOverrideBlocks: diskBlocks,
		CacheStatsMaxRequests:   1000,
		CacheStatsLogInterval:   5 * time.Second,
	}
	if mod != nil {
		mod(cfg)
	}
	e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
	o := Options{
		Config: cfg, BlockSize: bs, BytesPerBlock: 1 << 20, NumWorkers: 1,
		Sink: e.sink, Metrics: e.m, WorkerID: 7, Now: e.clock.Now,
		Logger: slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if opt != nil {
		opt(&o)
	}
	l, err := New(o)
	require.NoError(t, err)
	e.l = l
	return e
}

// toks returns n tokens starting at from (distinct prompts: distinct from).
func toks(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func seqHashes(tokens []uint32) []uint64 {
	return hashing.SequenceHashes(tokens, bs, hashing.DefaultSaltHash, nil)
}

// seed registers the given blocks (by index into hashes) in tier p, inactive.
func seed(t *testing.T, p *pool.Pool, tokens []uint32, blocks ...int) {
	t.Helper()
	hs := seqHashes(tokens)
	for _, i := range blocks {
		got := p.Allocate(1, nil)
		require.Len(t, got, 1)
		var parent uint64
		if i > 0 {
			parent = hs[i-1]
		}
		idx, _ := p.Register(got[0], hs[i], parent, i > 0, tokens[i*bs:(i+1)*bs], 0)
		p.Release(idx)
	}
}

func (e *env) step(t testing.TB, ups ...RequestUpdate) *plan.Step {
	t.Helper()
	b, err := e.l.Step(ups)
	require.NoError(t, err)
	st, err := plan.Decode(b)
	require.NoError(t, err)
	return st
}

func val(c prometheus.Collector) float64 { return testutil.ToFloat64(c) }

func save(src int64, dst plan.Tier, dstBlock int64) plan.Copy {
	return plan.Copy{Src: plan.G1, SrcBlock: src, Dst: dst, DstBlock: dstBlock}
}

func seqHashesSalt(tokens []uint32, salt uint64) []uint64 {
	return hashing.SequenceHashes(tokens, bs, salt, nil)
}
