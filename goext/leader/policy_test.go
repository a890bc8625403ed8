package leader

import (
	"bytes"
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// teach makes tier t of l's model cost lat + perMB a MB (many loads of
// two sizes).
func teach(l *Leader, t plan.Tier, lat time.Duration, perMB float64) {
	for i := range 400 {
		mb := float64(1 + i%2*7)
		l.CostModel().ObserveLoad(t, int64(mb*1e6), lat+time.Duration(perMB*mb*1e9))
	}
}

// A prompt of 6 blocks: 3 in G2, the next 3 in G3; one block (4 tokens at
// 100 µs) costs 0.4 ms to compute, and a block is ~1 MB. With G3 slow
// (50 ms a load) the cost policy loads the G2 prefix and leaves the G3
// blocks to the engine, counted; with G3 fast it loads all six.
func TestLoadPolicyCostPerTier(t *testing.T) {
	prompt := toks(0, 6*bs+1)
	run := func(g3 time.Duration) (int, *env) {
		e := newEnv(t, 8, 8, func(c *config.Config) {
			c.LoadPolicy = config.LoadPolicy{Mode: config.LoadCost, PrefillUsPerToken: 100}
		})
		seed(t, e.l.host, prompt, 0, 1, 2)
		seed(t, e.l.disk, prompt, 3, 4, 5)
		teach(e.l, plan.G2, 10*time.Microsecond, 1e-5)
		teach(e.l, plan.G3, g3, 1e-5)
		n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.True(t, async)
		return n, e
	}
	n, e := run(50 * time.Millisecond)
	require.Equal(t, 3*bs, n)
	require.Equal(t, float64(3*bs), val(e.l.pol.pm.SkippedTokens.WithLabelValues("g3", policy.ReasonSlower)))
	require.Zero(t, val(e.l.pol.pm.SkippedTokens.WithLabelValues("g2", policy.ReasonSlower)))
	require.Contains(t, e.logs.String(), "kvbm: load policy")
	require.Contains(t, e.logs.String(), "skipped_g3=3")
	// The skipped blocks are not pinned: only the loaded ones are.
	e.l.UpdateStateAfterAlloc("r", []int64{0, 1, 2, 3, 4, 5, 6}, n)
	st := e.step(t)
	require.Len(t, st.Loads, 1)
	for _, c := range st.Loads[0].Copies {
		require.Equal(t, plan.G2, c.Src)
	}

	n, e = run(100 * time.Microsecond)
	require.Equal(t, 6*bs, n)
	require.Zero(t, val(e.l.pol.pm.SkippedTokens.WithLabelValues("g3", policy.ReasonSlower)))
}

// always (the default) loads whatever matched, however slow.
func TestLoadPolicyAlwaysIsTodaysBehaviour(t *testing.T) {
	prompt := toks(0, 6*bs+1)
	e := newEnv(t, 8, 8, nil)
	seed(t, e.l.host, prompt, 0, 1, 2)
	seed(t, e.l.disk, prompt, 3, 4, 5)
	teach(e.l, plan.G3, time.Second, 1)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 6*bs, n)
	require.NotContains(t, e.logs.String(), "kvbm: load policy")
}

func TestLoadPolicyBound(t *testing.T) {
	prompt := toks(0, 6*bs+1)
	e := newEnv(t, 8, 8, func(c *config.Config) {
		c.LoadPolicy = config.LoadPolicy{Mode: config.LoadCap, CapMs: 5}
	})
	seed(t, e.l.host, prompt, 0, 1, 2, 3, 4, 5)
	// BytesPerBlock is 1 MiB: ~1.05 ms a block, no latency.
	teach(e.l, plan.G2, 0, 1e-3)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 4*bs, n)
	require.Equal(t, float64(2*bs), val(e.l.pol.pm.SkippedTokens.WithLabelValues("g2", policy.ReasonOverCap)))
}

// The prefill cost comes from the time between steps and what they
// scheduled.
func TestLoadPolicyLearnsPrefillFromSteps(t *testing.T) {
	e := newEnv(t, 64, 0, func(c *config.Config) { c.LoadPolicy.Mode = config.LoadCost })
	before := e.l.CostModel().PrefillPerToken()
	for i := range 100 {
		n := policy.MinStepTokens + (i%5)*100
		e.step(t, RequestUpdate{ReqID: "r", NewTokens: toks(i*1000, n), NumScheduledTokens: n, Resumed: true})
		e.clock.Advance(time.Millisecond + time.Duration(n)*time.Millisecond)
	}
	got := e.l.CostModel().PrefillPerToken()
	require.NotEqual(t, before, got)
	require.InEpsilon(t, float64(time.Millisecond), float64(got), 0.1)
}

// newAdmissionEnv: G2 (and G3 when disk > 0) with the given admission, and
// G4 (registry only) when object is set.
func newAdmissionEnv(t testing.TB, disk int, a config.Admission, g4 bool) *env {
	t.Helper()
	e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
	o := Options{
		Config: &config.Config{CPUCacheOverrideBlocks: 256, DiskCacheOverrideBlocks: disk, CacheStatsMaxRequests: 1000,
			CacheStatsLogInterval: 5 * time.Second, Admission: a},
		BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Sink: e.sink, Metrics: e.m, Now: e.clock.Now,
		Logger: slog.New(slog.NewTextHandler(e.logs, nil)),
	}
	if g4 {
		o.G4 = &G4Options{WriteThrough: true}
	}
	l, err := New(o)
	require.NoError(t, err)
	e.l = l
	return e
}

// request runs one request of prompt through matching, its load (if any)
// and its saves; it returns the plans of its steps.
func (e *env) request(t testing.TB, id string, prompt []uint32) []*plan.Step {
	t.Helper()
	ids := make([]int64, len(prompt)/bs+1)
	for i := range ids {
		ids[i] = int64(i)
	}
	var steps []*plan.Step
	n, _ := e.l.GetNumNewMatchedTokens(id, prompt, 0, 0)
	if n > 0 {
		e.l.UpdateStateAfterAlloc(id, ids, n)
		steps = append(steps, e.step(t))
		e.l.LoadsFinished([]string{id})
	}
	steps = append(steps, e.step(t, RequestUpdate{ReqID: id, NewTokens: prompt, NewBlockIDs: ids,
		NumComputedTokens: n, NumScheduledTokens: len(prompt) - n}))
	e.l.RequestFinished(id)
	return steps
}

func count(steps []*plan.Step, f func(*plan.Step) int) int {
	n := 0
	for _, s := range steps {
		n += f(s)
	}
	return n
}

func uploads(s *plan.Step) int { return len(s.Uploads) }
func moves(s *plan.Step) int   { return len(s.Moves) }

// G4 under the sketch: unique prompts upload nothing; a prefix seen again
// is uploaded (from G2, at the next step), once. Under "all" every saved
// block is uploaded.
func TestObjectAdmissionSketch(t *testing.T) {
	for _, mode := range []string{config.AdmitAll, config.AdmitSketch} {
		e := newAdmissionEnv(t, 0, config.Admission{Object: mode}, true)
		var steps []*plan.Step
		for i := range 20 {
			steps = append(steps, e.request(t, "u"+string(rune('a'+i)), toks(10_000*(i+1), 3*bs+1))...)
		}
		if mode == config.AdmitAll {
			require.Equal(t, 60, count(steps, uploads))
			continue
		}
		require.Zero(t, count(steps, uploads), "unique prompts upload nothing")
		require.Equal(t, float64(60), val(e.l.pol.pm.Rejected.WithLabelValues("g4", policy.RejectCold)))

		shared := toks(0, 3*bs)
		steps = nil
		for i := range 4 {
			prompt := append(append([]uint32(nil), shared...), toks(500_000+i*100, bs+1)...)
			steps = append(steps, e.request(t, "s"+string(rune('a'+i)), prompt)...)
		}
		steps = append(steps, e.step(t)) // pending uploads go out
		require.Equal(t, 3, count(steps, uploads), "the shared prefix, once")
		got := map[uint64]bool{}
		for _, s := range steps {
			for _, u := range s.Uploads {
				got[u.Hash] = true
			}
		}
		for _, h := range seqHashes(shared) {
			require.True(t, got[h])
		}
	}
}

// A G2→G3 budget: with every block admitted, writes beyond the budget are
// dropped and counted.
func TestDiskWriteBudget(t *testing.T) {
	// 64-byte blocks: 640 bytes a second is 10 blocks a second.
	e := newAdmissionEnv(t, 256, config.Admission{Disk: config.AdmitAll, DiskWriteMBps: 640e-6}, false)
	var steps []*plan.Step
	for i := range 10 {
		steps = append(steps, e.request(t, "u"+string(rune('a'+i)), toks(10_000*(i+1), 3*bs+1))...)
	}
	steps = append(steps, e.step(t))
	require.Equal(t, 5, count(steps, moves), "half the bucket for blocks that are not hot")
	require.Equal(t, float64(25), val(e.l.pol.pm.Rejected.WithLabelValues("g3", policy.RejectBudget)))
	require.Equal(t, float64(5), val(e.l.pol.pm.Admitted.WithLabelValues("g3")))
}

func TestAdmissionBadConfig(t *testing.T) {
	_, err := New(Options{Config: &config.Config{CPUCacheOverrideBlocks: 8,
		Admission: config.Admission{Object: "frequency"}}, BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1,
		G4: &G4Options{}})
	require.ErrorContains(t, err, "leader: DYN_KVBM_OBJECT_ADMISSION")
	_, err = New(Options{Config: &config.Config{CPUCacheOverrideBlocks: 8,
		LoadPolicy: config.LoadPolicy{Mode: "fastest"}}, BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1})
	require.ErrorContains(t, err, "leader: policy: unknown load policy")
}

// Without workers in its process, the leader times its G3/G4 loads itself:
// from the step that emitted them to the one that learnt they finished.
func TestLoadPolicyTimesLoadsItself(t *testing.T) {
	prompt := toks(0, 4*bs+1)
	e := newEnv(t, 8, 8, func(c *config.Config) { c.LoadPolicy.Mode = config.LoadCost })
	seed(t, e.l.host, prompt, 0, 1)
	seed(t, e.l.disk, prompt, 2, 3)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 4*bs, n, "G3 never measured: loaded")
	e.l.UpdateStateAfterAlloc("r", []int64{0, 1, 2, 3, 4}, n)
	e.step(t)
	e.clock.Advance(400 * time.Millisecond)
	e.l.LoadsFinished([]string{"r"})
	s := e.l.CostModel().Snapshot()
	require.Equal(t, uint64(1), s.Measured[plan.G3])
	require.Zero(t, s.Measured[plan.G2])
	require.Greater(t, s.Tier[plan.G3].Seconds(2*1.048576), 0.3)
}

// With G4 known to lose against recomputing, the cost policy does not
// even look the request up (nor match what the registry knows); with G4
// fast it does.
func TestLoadPolicySkipsAHopelessG4Lookup(t *testing.T) {
	prompt := toks(0, 4*bs+1)
	for _, slow := range []bool{true, false} {
		e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
		reg := object.NewRegistry(100)
		for _, h := range seqHashes(prompt) {
			reg.Add(h)
		}
		l, err := New(Options{
			Config: &config.Config{CPUCacheOverrideBlocks: 16, CacheStatsMaxRequests: 10, CacheStatsLogInterval: time.Hour,
				LoadPolicy: config.LoadPolicy{Mode: config.LoadCost, PrefillUsPerToken: 100}},
			BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Metrics: e.m, Now: e.clock.Now,
			Logger: slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
			G4:     &G4Options{Registry: reg},
		})
		require.NoError(t, err)
		lat := time.Millisecond
		if slow {
			lat = time.Second
		}
		l.CostModel().SetDownloadWave(0, 0) // teach's MB-sized loads of 64-byte blocks: one wave each
		teach(l, plan.G4, lat, 0)
		n, _ := l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		if slow {
			require.Zero(t, n)
			require.Equal(t, float64(1), val(l.pol.pm.LookupsSkipped))
			require.Contains(t, e.logs.String(), "not looking up G4")
		} else {
			require.Equal(t, 4*bs, n)
			require.Zero(t, val(l.pol.pm.LookupsSkipped))
		}
	}
}

// A G4 whose downloads are fast but whose lookups are slow loses too: the
// lookup's measured time comes before any block moves, so the cost policy
// does not start one that cannot pay for itself; with fast lookups it does.
func TestLoadPolicyCountsTheLookup(t *testing.T) {
	for _, slowLookup := range []bool{true, false} {
		e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
		l, err := New(Options{
			Config: &config.Config{CPUCacheOverrideBlocks: 16, CacheStatsMaxRequests: 10, CacheStatsLogInterval: time.Hour,
				LoadPolicy: config.LoadPolicy{Mode: config.LoadCost, PrefillUsPerToken: 100}},
			BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Metrics: e.m, Now: e.clock.Now,
			Logger: slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
			G4:     &G4Options{Registry: object.NewRegistry(100)},
		})
		require.NoError(t, err)
		teach(l, plan.G4, time.Millisecond, 0)
		// Recomputing the 4 blocks costs 4·bs·100 µs, loading them from G4
		// about 1 ms: a lookup of a second loses, one of 10 µs does not.
		lookup := 10 * time.Microsecond
		if slowLookup {
			lookup = time.Second
		}
		l.CostModel().ObserveLookup(lookup, 1)
		l.mu.Lock()
		worth := l.g4WorthLooking("r", 4)
		l.mu.Unlock()
		require.Equal(t, !slowLookup, worth)
		require.Equal(t, map[bool]float64{true: 1, false: 0}[slowLookup], val(l.pol.pm.LookupsSkipped))
	}
}

// A lookup is counted in the waves of HEAD requests the store issues: one
// that found its first block measured two round trips (the first block,
// then the rest side by side), one that did not measured one. A measured
// 40 ms round trip makes a 4-block lookup cost 80 ms: more than the 64 ms
// that recomputing 4 blocks costs (the mean of lookups alone, 40 ms, would
// have looked).
func TestLoadPolicyCountsLookupWaves(t *testing.T) {
	e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
	l, err := New(Options{
		Config: &config.Config{CPUCacheOverrideBlocks: 16, CacheStatsMaxRequests: 10, CacheStatsLogInterval: time.Hour,
			LoadPolicy: config.LoadPolicy{Mode: config.LoadCost, PrefillUsPerToken: 4000}}, // a block: 16 ms
		BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Metrics: e.m, Now: e.clock.Now,
		Logger: slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		G4:     &G4Options{Registry: object.NewRegistry(100)},
	})
	require.NoError(t, err)
	teach(l, plan.G4, time.Microsecond, 0)
	hit := &clockedG4{memG4: newMemG4(true), clock: e.clock, took: 80 * time.Millisecond}
	hashes := []uint64{1, 2, 3, 4}
	for _, h := range hashes {
		hit.stored[h] = true
	}
	l.g4Lookup(hit, &g4Probe{}, 0, hashes)
	require.InDelta(t, 0.04, l.CostModel().LookupSeconds(1, 32), 1e-9, "two waves of 40 ms")
	miss := &clockedG4{memG4: newMemG4(true), clock: e.clock, took: 40 * time.Millisecond}
	l.g4Lookup(miss, &g4Probe{}, 0, []uint64{5, 6, 7, 8})
	require.InDelta(t, 0.04, l.CostModel().LookupSeconds(1, 32), 1e-9, "one wave of 40 ms")
	l.mu.Lock()
	worth := l.g4WorthLooking("r", 4)
	// A request whose lookup was started (when it still looked worth it)
	// goes on to match: the lookup's time is spent.
	l.g4.probes["started"] = &g4Probe{done: true}
	started := l.g4WorthLooking("started", 4)
	l.mu.Unlock()
	require.False(t, worth)
	require.True(t, started)
	require.Equal(t, float64(1), val(l.pol.pm.LookupsSkipped))
}

// clockedG4 is a memG4 whose lookups take took on the test clock.
type clockedG4 struct {
	*memG4
	clock *fakeClock
	took  time.Duration
}

func (c *clockedG4) LookupSalted(ctx context.Context, salt uint64, hashes []uint64) int {
	c.clock.Advance(c.took)
	return c.memG4.LookupSalted(ctx, salt, hashes)
}

// The leader times a G4 load end to end, from the load decision to the
// engine step after it was reported finished (the step the request
// computes in), and the cost policy then expects no less: downloads timed
// fast by the workers in this process, but requests that waited a second
// for them, make the next request of that prefix recompute.
func TestLoadPolicyLearnsTheEndToEndWait(t *testing.T) {
	prompt := toks(0, 4*bs+1)
	reg := object.NewRegistry(100)
	for _, h := range seqHashes(prompt) {
		reg.Add(h)
	}
	e := newEnvWith(t, 16, 0, func(c *config.Config) {
		c.LoadPolicy = config.LoadPolicy{Mode: config.LoadCost, PrefillUsPerToken: 1000} // 4 blocks: 16 ms
	}, func(o *Options) { o.G4 = &G4Options{Registry: reg} })
	for i := range 400 { // the workers' own timings: 1 ms a download
		e.l.CostModel().ObserveTransfer("g4_to_g2", int64(1+i%2)<<20, time.Millisecond)
		e.l.CostModel().ObserveTransfer("g2_to_g1", int64(1+i%2)<<20, 10*time.Microsecond)
	}
	n, _ := e.l.GetNumNewMatchedTokens("r1", prompt, 0, 0)
	require.Equal(t, 4*bs, n, e.logs.String())
	e.l.UpdateStateAfterAlloc("r1", []int64{0, 1, 2, 3, 4}, n)
	st := e.step(t)
	require.Len(t, st.Loads, 1)
	e.clock.Advance(900 * time.Millisecond)
	e.l.LoadsFinished([]string{"r1"})
	mb := 4 * float64(1<<20) / 1e6
	_, ok := e.l.CostModel().EndToEnd(plan.G4, mb)
	require.False(t, ok, "timed at the next step")
	e.clock.Advance(100 * time.Millisecond)
	e.step(t)
	got, ok := e.l.CostModel().EndToEnd(plan.G4, mb)
	require.True(t, ok)
	require.InDelta(t, 1.0, got, 1e-9)

	n, _ = e.l.GetNumNewMatchedTokens("r2", prompt, 0, 0)
	require.Zero(t, n)
	require.Equal(t, float64(1), val(e.l.pol.pm.LookupsSkipped), "not even matched in G4")
}
