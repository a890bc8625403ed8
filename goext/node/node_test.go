package node

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/internal/testports"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/worker"
	"github.com/kvbm/kvbm/internal/s3test"
)

const (
	bs      = 4
	nBlocks = 8
	heads   = 2
	hdim    = 8
	layers  = 2
)

// cpuSpec is a CPU-layout KV cache in anonymous memory (outside the Go
// heap, as an engine's would be), with groups KV cache groups when > 1.
func cpuSpec(t *testing.T, groups int) layout.Spec {
	t.Helper()
	shape := []int64{2, nBlocks, heads, bs, hdim}
	n := int64(2)
	for _, d := range shape {
		n *= d
	}
	spec := layout.Spec{Kind: layout.CPU, NumBlocks: nBlocks, BlockSize: bs, DtypeBytes: 2}
	for l := 0; l < layers; l++ {
		m, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Munmap(m) })
		for i := range m {
			m[i] = byte(i*7 + l)
		}
		spec.Tensors = append(spec.Tensors, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: shape})
	}
	if groups > 1 {
		for l := range layers {
			spec.LayerGroups = append(spec.LayerGroups, l%groups)
		}
	}
	return spec
}

func testConfig(t *testing.T, env map[string]string) *config.Config {
	t.Helper()
	cfg, err := config.FromEnv(env)
	require.NoError(t, err)
	return cfg
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// TestWorkerAndLeaderThroughNode builds a worker and a leader of one
// process through the front door, runs a step that saves a prompt's
// blocks, and matches them for a second request.
func TestWorkerAndLeaderThroughNode(t *testing.T) {
	cfg := testConfig(t, map[string]string{config.EnvCPUCacheOverrideBlocks: "16"})
	d := Deps{Registry: NewRegistry(), Logger: quiet()}
	w, err := NewWorker(cfg, WorkerSpec{Layout: cpuSpec(t, 1), Model: "m", DType: "bf16"}, d)
	require.NoError(t, err)
	defer w.Close()
	require.Equal(t, 16, w.HostBlocks)
	require.Nil(t, w.G1)
	require.Same(t, d.Registry.WorkerMetrics(), w.Metrics)

	l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: w.Layout.BytesPerBlock(), NumWorkers: 1}, d)
	require.NoError(t, err)
	defer l.Close()

	prompt := make([]uint32, 3*bs)
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	got, _ := l.L.GetNumNewMatchedTokens("a", prompt, 0, 0)
	require.Equal(t, 0, got)
	l.L.UpdateStateAfterAlloc("a", []int64{0, 1, 2}, 0)
	b, err := l.L.Step([]leader.RequestUpdate{{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{0, 1, 2},
		NumScheduledTokens: len(prompt)}})
	require.NoError(t, err)
	require.NoError(t, w.W.BindStep(b))
	w.W.StartLoad()
	w.W.WaitForSave()
	l.L.RequestFinished("a")

	// Three full blocks stored in G2; the last is left to the engine
	// (LoadFullHit off), so two blocks' tokens match.
	got, _ = l.L.GetNumNewMatchedTokens("b", prompt, 0, 0)
	require.Equal(t, 2*bs, got)
}

// TestConsolidatorThroughNode: a leader started with a consolidator feeds
// it its tier events in-process.
func TestConsolidatorThroughNode(t *testing.T) {
	cfg := testConfig(t, map[string]string{config.EnvCPUCacheOverrideBlocks: "16"})
	d := Deps{Registry: NewRegistry(), Logger: quiet()}
	l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1,
		Consolidator: &ConsolidatorSpec{ZMQBind: fmt.Sprintf("tcp://127.0.0.1:%d", testports.Free(t, 1)[0])},
		TierEvents:   true}, d)
	require.NoError(t, err)
	defer l.Close()
	require.NotNil(t, l.Consolidator)
	prompt := make([]uint32, 2*bs)
	l.L.UpdateStateAfterAlloc("a", []int64{0, 1}, 0)
	_, err = l.L.Step([]leader.RequestUpdate{{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{0, 1},
		NumScheduledTokens: len(prompt)}})
	require.NoError(t, err)
	require.Equal(t, uint64(2), l.Consolidator.Stats().EventsIn)
	require.Len(t, l.TierEvents.Drain(), 2)

	_, err = NewConsolidator(cfg, ConsolidatorSpec{Engine: "nope"}, nil, quiet())
	k, ok := KindOf(err)
	require.True(t, ok)
	require.Equal(t, KindInvalid, k)
}

// recorder is a G1 copier that records its Close, standing in for the
// CUDA copier.
type recorder struct {
	mu     sync.Mutex
	log    *[]string
	closed int
}

func (r *recorder) RegisterHost(*storage.HostRegion) error { return nil }
func (r *recorder) Fence() error                           { return nil }
func (r *recorder) GatherBlocks([]int, [][]byte) error     { return nil }
func (r *recorder) ScatterBlocks([]int, [][]byte) error    { return nil }
func (r *recorder) MaxBatch() int                          { return 0 }
func (r *recorder) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed++
	*r.log = append(*r.log, "copier")
	return nil
}

func g4Env(t *testing.T) map[string]string {
	f := s3test.StartFake(t)
	return map[string]string{
		config.EnvCPUCacheOverrideBlocks: "16",
		config.EnvObjectEnabled:          "true",
		config.EnvObjectEndpoint:         "http://" + f.Addr,
		config.EnvObjectBucket:           "kv-node",
		config.EnvObjectAccessKey:        s3test.AccessKey,
		config.EnvObjectSecretKey:        s3test.SecretKey,
	}
}

// TestWorkerFailureClosesInReverse injects a failure at each later step of
// NewWorker and checks that everything opened before it was closed: the
// copier once (by the worker once it owns it), the G4 store's reference,
// rank 0's fingerprint.
func TestWorkerFailureClosesInReverse(t *testing.T) {
	env := g4Env(t)
	for _, tc := range []struct {
		name   string
		groups int
		side   *WorkerSideChannel
		kind   Kind
		want   string
	}{
		// The copier refuses KV cache groups: nothing else was opened.
		{name: "groups", groups: 2, kind: KindConfig, want: "KV cache groups"},
		// The side channel fails last: worker, G4 store and rank 0's
		// fingerprint were opened and are released.
		{name: "side channel", groups: 1, side: &WorkerSideChannel{Transport: "carrier-pigeon"}, kind: KindInvalid,
			want: "side_channel"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log []string
			rec := &recorder{log: &log}
			reg := NewRegistry()
			d := Deps{Registry: reg, Logger: quiet(),
				NewCopier: func(*layout.Engine, *config.Config) (worker.G1Copier, error) { return rec, nil }}
			_, err := NewWorker(testConfig(t, env), WorkerSpec{Layout: cpuSpec(t, tc.groups), Model: "m",
				SideChannel: tc.side}, d)
			require.ErrorContains(t, err, tc.want)
			k, ok := KindOf(err)
			require.True(t, ok)
			require.Equal(t, tc.kind, k)
			require.Equal(t, 1, rec.closed, "the copier is closed once")
			require.Equal(t, 0, reg.OpenStores(), "the G4 store is released")
		})
	}
}

// rowRecorder is a recorder that copies per KV cache group.
type rowRecorder struct{ recorder }

func (r *rowRecorder) GatherRows([][]int64, [][]byte) error  { return nil }
func (r *rowRecorder) ScatterRows([][]int64, [][]byte) error { return nil }

// TestGroupsNeedARowCopier: KV cache groups are served with a copier that
// copies per group (the CUDA one), refused with one that moves whole blocks
// only (TestWorkerFailureClosesInReverse), and need none on host memory.
func TestGroupsNeedARowCopier(t *testing.T) {
	var log []string
	rec := &rowRecorder{recorder{log: &log}}
	d := Deps{Registry: NewRegistry(), Logger: quiet(),
		NewCopier: func(*layout.Engine, *config.Config) (worker.G1Copier, error) { return rec, nil }}
	w, err := NewWorker(testConfig(t, map[string]string{config.EnvCPUCacheOverrideBlocks: "16"}), WorkerSpec{Layout: cpuSpec(t, 2), Model: "m"}, d)
	require.NoError(t, err)
	require.Same(t, worker.G1Copier(rec), w.G1)
	require.Equal(t, 2, w.Layout.NumGroups())
	w.Close()
	require.Equal(t, 1, rec.closed)

	w, err = NewWorker(testConfig(t, map[string]string{config.EnvCPUCacheOverrideBlocks: "16"}), WorkerSpec{Layout: cpuSpec(t, 2), Model: "m"}, Deps{Registry: NewRegistry(), Logger: quiet()})
	require.NoError(t, err)
	w.Close()
}

// TestCopierFailure: a copier that fails to open fails the worker as an
// I/O error and opens nothing else.
func TestCopierFailure(t *testing.T) {
	reg := NewRegistry()
	d := Deps{Registry: reg, Logger: quiet(), NewCopier: func(*layout.Engine, *config.Config) (worker.G1Copier, error) {
		return nil, fmt.Errorf("cuda: no device")
	}}
	_, err := NewWorker(testConfig(t, g4Env(t)), WorkerSpec{Layout: cpuSpec(t, 1)}, d)
	require.ErrorContains(t, err, "cuda: no device")
	k, _ := KindOf(err)
	require.Equal(t, KindIO, k)
	require.Equal(t, 0, reg.OpenStores())
}

// TestWorkerAndLeaderShareG4: the leader and the rank 0 worker of one
// registry share rank 0's store; it closes with its last user. The leader
// gets rank 0's fingerprint as in any process layout: from the engine
// (here in its spec), never from the registry.
func TestWorkerAndLeaderShareG4(t *testing.T) {
	cfg := testConfig(t, g4Env(t))
	reg := NewRegistry()
	d := Deps{Registry: reg, Logger: quiet()}
	w, err := NewWorker(cfg, WorkerSpec{Layout: cpuSpec(t, 1), Model: "m"}, d)
	require.NoError(t, err)
	require.NotNil(t, w.G4)
	l0, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: w.Layout.BytesPerBlock(), NumWorkers: 1}, d)
	require.NoError(t, err)
	require.Nil(t, l0.L.G4Store(), "no fingerprint yet: no G4 lookups")
	require.NoError(t, l0.SetG4Fingerprint(w.Fingerprint))
	require.Same(t, w.G4, l0.L.G4Store())
	l0.Close()
	l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: w.Layout.BytesPerBlock(), NumWorkers: 1,
		Fingerprint: w.Fingerprint.String()}, d)
	require.NoError(t, err)
	require.Same(t, w.G4, l.L.G4Store())
	require.Equal(t, 1, reg.OpenStores())
	w.Close()
	require.Equal(t, 1, reg.OpenStores(), "the leader still holds it")
	l.Close()
	require.Equal(t, 0, reg.OpenStores())
}

// TestLeaderFailureClosesWhatItOpened: a leader whose G4 fingerprint does
// not parse fails after its consolidator started; the consolidator is
// closed (its output port can be bound again).
func TestLeaderFailureClosesWhatItOpened(t *testing.T) {
	cfg := testConfig(t, g4Env(t))
	reg := NewRegistry()
	d := Deps{Registry: reg, Logger: quiet()}
	bind := fmt.Sprintf("tcp://127.0.0.1:%d", testports.Free(t, 1)[0])
	_, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Fingerprint: "zz",
		Consolidator: &ConsolidatorSpec{ZMQBind: bind}}, d)
	require.Error(t, err)
	require.True(t, strings.HasPrefix(err.Error(), "kvbm_leader_new: "), err.Error())
	require.Equal(t, 0, reg.OpenStores())
	// The consolidator's output port is free again: it was closed.
	c, err := NewConsolidator(cfg, ConsolidatorSpec{ZMQBind: bind}, nil, quiet())
	require.NoError(t, err)
	require.NoError(t, c.Close())
}

// TestUndoRunsInReverse: what was opened last is closed first, once.
func TestUndoRunsInReverse(t *testing.T) {
	var u undo
	var got []int
	for i := range 4 {
		u.push(func() { got = append(got, i) })
	}
	u.run()
	u.run()
	require.Equal(t, []int{3, 2, 1, 0}, got)
}

// TestRestoreTakesTheIndexItsWorkerHandsOver: a leader created before its
// own workers (as a scheduler may be), in a process where an earlier
// engine's worker recovered and closed, registers the index its own worker
// hands over — never the gone worker's (the only route is the engine's).
func TestRestoreTakesTheIndexItsWorkerHandsOver(t *testing.T) {
	cfg := testConfig(t, map[string]string{config.EnvDiskCacheOverrideBlocks: "16",
		config.EnvDiskCacheDir: t.TempDir(), config.EnvDiskPersist: "true", config.EnvStorageSecret: "a test secret of 32 bytes......"})
	d := Deps{Registry: NewRegistry(), Logger: quiet()}
	spec := WorkerSpec{Layout: cpuSpec(t, 1), Model: "m", DType: "bf16"}
	prompt := make([]uint32, 3*bs)
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	pair := func() (*Leader, *Worker) {
		l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: 2 * layers * bs * heads * hdim * 2}, d)
		require.NoError(t, err)
		w, err := NewWorker(cfg, spec, d)
		require.NoError(t, err)
		require.Equal(t, l.bytesPerBlock, w.Layout.BytesPerBlock())
		return l, w
	}

	l, w := pair() // the leader first: this worker's (empty) index stays offered until it closes
	got, _ := l.L.GetNumNewMatchedTokens("a", prompt, 0, 0)
	require.Equal(t, 0, got)
	b, err := l.L.Step([]leader.RequestUpdate{{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{0, 1, 2},
		NumScheduledTokens: len(prompt)}})
	require.NoError(t, err)
	require.NoError(t, w.W.BindStep(b))
	w.W.StartLoad()
	w.W.WaitForSave()
	l.L.RequestFinished("a")
	w.Close()
	l.Close()

	l, w = pair()
	defer l.Close()
	defer w.Close()
	require.Len(t, w.W.Recovered().Blocks, 3)
	var rr RecoveredRank
	require.NoError(t, msgpack.Unmarshal(w.Recovered, &rr))
	n, err := l.RestoreDisk([]RecoveredRank{rr})
	require.NoError(t, err)
	require.Equal(t, 3, n, "the restore went to the closed worker's index")
	got, _ = l.L.GetNumNewMatchedTokens("b", prompt, 0, 0)
	require.Equal(t, 2*bs, got)
}

// TestG4LookupTimeoutReachesTheLeader: DYN_KVBM_OBJECT_LOOKUP_TIMEOUT_SECS
// bounds the leader's look-ups (the default where unset).
func TestG4LookupTimeoutReachesTheLeader(t *testing.T) {
	env := g4Env(t)
	for raw, want := range map[string]time.Duration{"": config.DefaultObjectLookupTimeout, "30": 30 * time.Second} {
		env[config.EnvObjectLookupTimeoutSecs] = raw
		n := &Leader{cfg: testConfig(t, env)}
		opts, err := n.g4Options(LeaderSpec{}, NewRegistry(), quiet())
		require.NoError(t, err)
		require.Equal(t, want, opts.LookupTimeout, "%q", raw)
	}
}
