package worker

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// admissionRig is a leader planning for a worker with a real G3 disk tier.
type admissionRig struct {
	l  *leader.Leader
	w  *Worker
	lm *metrics.Metrics
}

func newAdmissionRig(t *testing.T, disk string) *admissionRig {
	t.Helper()
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, Options{HostBlocks: 64, DiskBlocks: 128, DiskDir: t.TempDir(), DisableODirect: true})
	lm := metrics.New()
	l, err := leader.New(leader.Options{
		Config: &config.Config{CPUCacheOverrideBlocks: 64, DiskCacheOverrideBlocks: 128, CacheStatsMaxRequests: 100,
			CacheStatsLogInterval: time.Hour, Admission: config.Admission{Disk: disk}},
		BlockSize: bs, BytesPerBlock: w.BytesPerBlock(), NumWorkers: 1, Metrics: lm,
		Logger: slog.New(slog.NewTextHandler(t.Output(), nil)), ObserveTransfers: true,
	})
	require.NoError(t, err)
	t.Cleanup(l.Close)
	return &admissionRig{l: l, w: w, lm: lm}
}

func (r *admissionRig) step(t *testing.T, ups ...leader.RequestUpdate) {
	t.Helper()
	b, err := r.l.Step(ups)
	require.NoError(t, err)
	st, err := plan.Decode(b)
	require.NoError(t, err)
	loaded, failed := run(t, r.w, st)
	require.Empty(t, failed)
	if len(loaded) > 0 {
		r.l.LoadsFinished(loaded)
	}
}

// request: match, load what matched (its own step, as vLLM's async load),
// then compute the rest and save it.
func (r *admissionRig) request(t *testing.T, id string, prompt []uint32) (matched int) {
	t.Helper()
	ids := make([]int64, len(prompt)/bs+1)
	for i := range ids {
		ids[i] = int64(i)
	}
	n, _ := r.l.GetNumNewMatchedTokens(id, prompt, 0, 0)
	if n > 0 {
		r.l.UpdateStateAfterAlloc(id, ids, n)
		r.step(t)
	}
	r.step(t, leader.RequestUpdate{ReqID: id, NewTokens: prompt, NewBlockIDs: ids,
		NumComputedTokens: max(n, 0), NumScheduledTokens: len(prompt) - max(n, 0)})
	r.l.RequestFinished(id)
	return max(n, 0)
}

func (r *admissionRig) diskWrites() uint64 { return r.w.TransferStats()["g2_to_g3"].Blocks }

func promptOf(from, blocks int) []uint32 {
	out := make([]uint32, blocks*bs+1)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// Unique prompts under the sketch write nothing to G3 (under "all",
// every block); a prefix that four requests share is written once, and
// only that.
func TestDiskAdmissionSketchOnRealDiskTier(t *testing.T) {
	for _, mode := range []string{config.AdmitAll, config.AdmitSketch} {
		t.Run(mode, func(t *testing.T) {
			r := newAdmissionRig(t, mode)
			for i := range 30 {
				r.request(t, fmt.Sprint("u", i), promptOf(10_000*(i+1), 3))
			}
			r.step(t) // queued moves go out
			if mode == config.AdmitAll {
				require.Equal(t, uint64(90), r.diskWrites())
				return
			}
			require.Zero(t, r.diskWrites(), "unique prompts")
			pm := policy.NewMetrics(r.lm.Registry, nil) // the leader's counters
			require.Equal(t, float64(90), testutil.ToFloat64(pm.Rejected.WithLabelValues("g3", policy.RejectCold)))

			shared := promptOf(0, 3)[:3*bs]
			for i := range 4 {
				prompt := append(append([]uint32(nil), shared...), promptOf(500_000+100*i, 1)...)
				got := r.request(t, fmt.Sprint("s", i), prompt)
				if i > 0 {
					require.Equal(t, 3*bs, got, "the shared prefix is served")
				}
			}
			r.step(t)
			require.Equal(t, uint64(3), r.diskWrites(), "the shared prefix, once")
			require.Equal(t, float64(3), testutil.ToFloat64(pm.Admitted.WithLabelValues("g3")))
			require.Equal(t, float64(3), testutil.ToFloat64(r.lm.DiskBlocksUsed))
			// The worker's timed G2 → G1 loads reached the leader's model.
			require.NotZero(t, r.l.CostModel().Snapshot().Measured[plan.G2])
		})
	}
}
