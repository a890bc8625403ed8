package worker

import (
	"bytes"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/transfer"
)

// g1 is CPU memory standing in for an engine's KV cache.
type g1 struct {
	e    *layout.Engine
	mems [][]byte
	rng  *rand.Rand
}

const (
	nBlocks = 40
	bs      = 4
	heads   = 3
	hdim    = 8
	layers  = 3
)

// newG1 allocates (mmap, outside the Go heap, as engine memory would be) and
// fills with random bytes a KV cache of the given kind.
func newG1(t *testing.T, kind layout.Kind) *g1 {
	t.Helper()
	var shape, strides []int64
	nt := layers
	switch kind {
	case layout.FlashAttn:
		shape = []int64{2, nBlocks, bs, heads, hdim}
	case layout.FlashInfer:
		shape = []int64{nBlocks, 2, bs, heads, hdim}
	case layout.CPU:
		shape = []int64{2, nBlocks, heads, bs, hdim}
	case layout.MLA:
		shape = []int64{nBlocks, bs, 72}
	case layout.TRTLLM:
		shape, nt = []int64{nBlocks, layers, 2, heads * bs * hdim}, 1
	case layout.Auto: // FlashAttention shape over HND storage: [2, N, bs, H, D] with bs and H strides swapped
		shape = []int64{2, nBlocks, bs, heads, hdim}
		strides = []int64{nBlocks * heads * bs * hdim, heads * bs * hdim, hdim, bs * hdim, 1}
	}
	n := int64(2)
	for _, d := range shape {
		n *= d
	}
	g := &g1{rng: rand.New(rand.NewPCG(uint64(kind), 99))}
	var ts []layout.Tensor
	for i := 0; i < nt; i++ {
		m, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Munmap(m) })
		g.mems = append(g.mems, m)
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: shape, Strides: strides})
	}
	hint := kind
	if kind == layout.Auto {
		hint = layout.FlashAttn
	}
	e, err := layout.NewEngine(layout.Spec{Kind: hint, Tensors: ts, NumBlocks: nBlocks, BlockSize: bs, DtypeBytes: 2})
	require.NoError(t, err)
	g.e = e
	g.scramble()
	return g
}

func (g *g1) scramble() {
	for _, m := range g.mems {
		for i := range m {
			m[i] = byte(g.rng.Uint32())
		}
	}
}

// block returns a copy of G1 block b in host layout.
func (g *g1) block(b int64) []byte {
	buf := make([]byte, g.e.BytesPerBlock())
	transfer.Gather(g.e, int(b), buf)
	return buf
}

func (g *g1) snapshot() [][]byte {
	out := make([][]byte, len(g.mems))
	for i, m := range g.mems {
		out[i] = bytes.Clone(m)
	}
	return out
}

func newWorker(t *testing.T, g *g1, opts Options) *Worker {
	t.Helper()
	if opts.Metrics == nil {
		opts.Metrics = metrics.New()
	}
	opts.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	w, err := New(opts)
	require.NoError(t, err)
	require.NoError(t, w.RegisterG1(g.e))
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	return w
}

// run binds one step (through its encoding, as the engine ships it) and
// executes it to completion, its background moves included.
func run(t *testing.T, w *Worker, s *plan.Step) (loaded []string, failed []int64) {
	t.Helper()
	b, err := s.Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(b))
	w.StartLoad()
	w.WaitForSave()
	w.WaitLoads()
	w.WaitMoves()
	loaded, failed = w.Finished()
	slices.Sort(loaded)
	slices.Sort(failed)
	return loaded, failed
}

func copies(src plan.Tier, srcs []int64, dst plan.Tier, dsts []int64) []plan.Copy {
	out := make([]plan.Copy, len(srcs))
	for i := range srcs {
		out[i] = plan.Copy{Src: src, SrcBlock: srcs[i], Dst: dst, DstBlock: dsts[i]}
	}
	return out
}

var allKinds = []struct {
	name string
	kind layout.Kind
}{
	{"flash_attn", layout.FlashAttn},
	{"flashinfer", layout.FlashInfer},
	{"cpu", layout.CPU},
	{"mla", layout.MLA},
	{"trtllm", layout.TRTLLM},
	{"flash_attn_hnd_strides", layout.Auto},
}

// TestRoundTrip: G1 → G2 → G3 → (G1 overwritten, G2 dropped) → G1 into other
// blocks, byte exact, for every layout, in parallel batches.
func TestRoundTrip(t *testing.T) {
	for _, k := range allKinds {
		t.Run(k.name, func(t *testing.T) {
			g := newG1(t, k.kind)
			m := metrics.New()
			w := newWorker(t, g, Options{HostBlocks: 16, DiskBlocks: 20, DiskDir: t.TempDir(), MaxConcurrent: 3, BatchSize: 2, Metrics: m})
			bpb := g.e.BytesPerBlock()

			src := []int64{3, 17, 0, 39, 8, 22, 5, 31, 11, 26} // scattered G1 blocks
			hostB := []int64{9, 0, 15, 4, 7, 2, 11, 13, 1, 6}
			diskB := []int64{19, 3, 0, 12, 7, 15, 1, 8, 10, 5}
			want := make([][]byte, len(src))
			for i, b := range src {
				want[i] = g.block(b)
			}

			_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, src, plan.G2, hostB)})
			require.Empty(t, failed)
			_, failed = run(t, w, &plan.Step{Seq: 2, Moves: copies(plan.G2, hostB, plan.G3, diskB)})
			require.Empty(t, failed)
			require.Equal(t, float64(len(src))*float64(bpb), testutil.ToFloat64(m.BytesMoved.WithLabelValues("g1_to_g2")))
			require.Equal(t, float64(len(src))*float64(bpb), testutil.ToFloat64(m.BytesMoved.WithLabelValues("g2_to_g3")))

			// The engine reuses its blocks; the host copies of the first half are
			// evicted, so those must come from disk.
			g.scramble()
			var drops []plan.Copy
			for _, h := range hostB[:5] {
				drops = append(drops, plan.Copy{Src: plan.G2, SrcBlock: h})
			}
			_, _ = run(t, w, &plan.Step{Seq: 3, Drops: drops})
			before := g.snapshot()

			targets := []int64{38, 1, 20, 14, 27, 33, 2, 9, 16, 25}
			loaded, failed := run(t, w, &plan.Step{Seq: 4, Loads: []plan.Load{
				{ReqID: "from-disk", Copies: copies(plan.G3, diskB[:5], plan.G1, targets[:5])},
				{ReqID: "from-host", Copies: copies(plan.G2, hostB[5:], plan.G1, targets[5:])},
				{ReqID: "empty"},
			}})
			require.Equal(t, []string{"empty", "from-disk", "from-host"}, loaded)
			require.Empty(t, failed)
			for i, b := range targets {
				require.Equal(t, want[i], g.block(b), "G1 block %d (from G1 block %d)", b, src[i])
			}
			// Nothing outside the target blocks changed, byte for byte (this
			// also covers padding and other regions of the tensors).
			after := g.snapshot()
			for _, b := range targets {
				for l := 0; l < g.e.NumLayers; l++ {
					for o := 0; o < g.e.OuterDim; o++ {
						ti, off := g.e.ChunkOffset(int(b), l, o)
						copy(before[ti][off:off+g.e.ChunkBytes], after[ti][off:off+g.e.ChunkBytes])
					}
				}
			}
			for i := range before {
				require.True(t, bytes.Equal(before[i], after[i]), "tensor %d changed outside the loaded blocks", i)
			}
			require.Equal(t, float64(5)*float64(bpb), testutil.ToFloat64(m.BytesMoved.WithLabelValues("g3_to_g1")))
		})
	}
}

// TestDiskOnlyAndStaging: G1 → G3 directly (disk-only mode), back to G1
// directly and through G2 staging in one load.
func TestDiskOnlyAndStaging(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 8, DiskDir: t.TempDir(), BatchSize: 1})
	src := []int64{5, 6, 7, 30}
	want := [][]byte{g.block(5), g.block(6), g.block(7), g.block(30)}
	_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, src, plan.G3, []int64{0, 1, 2, 3})})
	require.Empty(t, failed)
	g.scramble()
	loaded, failed := run(t, w, &plan.Step{Seq: 2, Loads: []plan.Load{{ReqID: "r", Copies: []plan.Copy{
		{Src: plan.G3, SrcBlock: 0, Dst: plan.G1, DstBlock: 10},
		{Src: plan.G2, SrcBlock: 3, Dst: plan.G1, DstBlock: 11}, // staged below
		{Src: plan.G3, SrcBlock: 1, Dst: plan.G2, DstBlock: 3},
		{Src: plan.G3, SrcBlock: 3, Dst: plan.G1, DstBlock: 13},
	}}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, want[0], g.block(10))
	require.Equal(t, want[1], g.block(11))
	require.Equal(t, want[3], g.block(13))
}

// TestCorruptDiskBlock flips one byte of one block in the disk file: that
// load fails (reported, never served, never retried from the same bytes);
// the others succeed.
func TestCorruptDiskBlock(t *testing.T) {
	g := newG1(t, layout.CPU)
	m := metrics.New()
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir(), Metrics: m})
	src := []int64{1, 2, 3}
	want := [][]byte{g.block(1), g.block(2), g.block(3)}
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, src, plan.G2, []int64{0, 1, 2})})
	run(t, w, &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0, 1, 2}, plan.G3, []int64{0, 1, 2})})

	f, err := os.OpenFile(w.DiskPath(), os.O_RDWR, 0)
	require.NoError(t, err)
	stride := layout.AlignUp(g.e.BytesPerBlock(), storage.Alignment)
	off := 1*stride + g.e.BytesPerBlock()/2
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	b[0] ^= 0x40
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	loaded, failed := run(t, w, &plan.Step{Seq: 3, Loads: []plan.Load{
		{ReqID: "r", Copies: copies(plan.G3, []int64{0, 1, 2}, plan.G1, []int64{20, 21, 22})},
	}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, []int64{21}, failed)
	require.Equal(t, want[0], g.block(20))
	require.Equal(t, want[2], g.block(22))

	// Even if the file were repaired, the block stays forgotten until rewritten.
	_, failed = run(t, w, &plan.Step{Seq: 4, Loads: []plan.Load{{ReqID: "again", Copies: copies(plan.G3, []int64{1}, plan.G2, []int64{3})}}})
	require.Empty(t, failed, "a staging failure is not a G1 failure")
	_, failed = run(t, w, &plan.Step{Seq: 5, Loads: []plan.Load{{ReqID: "again2", Copies: copies(plan.G2, []int64{3}, plan.G1, []int64{23})}}})
	require.Equal(t, []int64{23}, failed, "a G2 block whose staging read failed must not be served")
}

// TestInvalidSources: loads from blocks that were never written, dropped, or
// out of range fail per G1 block and never panic.
func TestInvalidSources(t *testing.T) {
	g := newG1(t, layout.FlashInfer)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 2, DiskDir: t.TempDir()})
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{0, 1}, plan.G2, []int64{0, 1})})
	run(t, w, &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{1}, plan.G3, []int64{1})})
	loaded, failed := run(t, w, &plan.Step{Seq: 3,
		Drops: []plan.Copy{{Src: plan.G2, SrcBlock: 1}, {Src: plan.G3, SrcBlock: 1}, {Src: plan.G3, SrcBlock: 99}},
		Loads: []plan.Load{{ReqID: "r", Copies: []plan.Copy{
			{Src: plan.G2, SrcBlock: 0, Dst: plan.G1, DstBlock: 10}, // fine
			{Src: plan.G2, SrcBlock: 2, Dst: plan.G1, DstBlock: 11}, // never written
			{Src: plan.G2, SrcBlock: 1, Dst: plan.G1, DstBlock: 12}, // dropped
			{Src: plan.G3, SrcBlock: 1, Dst: plan.G1, DstBlock: 13}, // dropped
			{Src: plan.G3, SrcBlock: 0, Dst: plan.G1, DstBlock: 14}, // never written
			{Src: plan.G2, SrcBlock: 7, Dst: plan.G1, DstBlock: 15}, // out of range
			{Src: plan.G2, SrcBlock: 0, Dst: plan.G1, DstBlock: 1000},
			{Src: plan.G1, SrcBlock: 0, Dst: plan.G1, DstBlock: 16}, // unsupported
		}}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, []int64{11, 12, 13, 14, 15, 16, 1000}, failed)

	// A move from an invalid G2 block leaves the disk block invalid too.
	run(t, w, &plan.Step{Seq: 4, Moves: copies(plan.G2, []int64{2}, plan.G3, []int64{0})})
	_, failed = run(t, w, &plan.Step{Seq: 5, Loads: []plan.Load{{ReqID: "x", Copies: copies(plan.G3, []int64{0}, plan.G1, []int64{3})}}})
	require.Equal(t, []int64{3}, failed)

	// A drop and a reuse of the same block in one step: the save wins.
	want := g.block(5)
	run(t, w, &plan.Step{Seq: 6, Drops: []plan.Copy{{Src: plan.G2, SrcBlock: 3}}, Saves: copies(plan.G1, []int64{5}, plan.G2, []int64{3})})
	_, failed = run(t, w, &plan.Step{Seq: 7, Loads: []plan.Load{{ReqID: "y", Copies: copies(plan.G2, []int64{3}, plan.G1, []int64{6})}}})
	require.Empty(t, failed)
	require.Equal(t, want, g.block(6))
}

// failingDisk wraps the real disk and fails every write after `okWrites`.
type failingDisk struct {
	blockDisk
	mu       sync.Mutex
	okWrites int
}

func (f *failingDisk) WriteBlock(i int, buf []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.okWrites <= 0 {
		return fmt.Errorf("write block %d: %w", i, unix.ENOSPC)
	}
	f.okWrites--
	return f.blockDisk.WriteBlock(i, buf)
}

// TestDiskDegrades: a disk I/O error at runtime switches G3 off (loads from
// it fail, moves are skipped) while G2 keeps working; nothing panics.
func TestDiskDegrades(t *testing.T) {
	g := newG1(t, layout.MLA)
	w := newWorker(t, g, Options{HostBlocks: 4, DiskBlocks: 4, DiskDir: t.TempDir(), BatchSize: 1, MaxConcurrent: 1})
	w.disk = &failingDisk{blockDisk: w.disk, okWrites: 1}
	want := g.block(2)
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2}, plan.G2, []int64{0, 1})})
	run(t, w, &plan.Step{Seq: 2, Moves: copies(plan.G2, []int64{0, 1}, plan.G3, []int64{0, 1})})
	require.True(t, w.DiskDegraded())
	loaded, failed := run(t, w, &plan.Step{Seq: 3, Loads: []plan.Load{{ReqID: "r", Copies: []plan.Copy{
		{Src: plan.G3, SrcBlock: 0, Dst: plan.G1, DstBlock: 10}, // was written, but the tier is off now
		{Src: plan.G3, SrcBlock: 1, Dst: plan.G1, DstBlock: 11},
		{Src: plan.G2, SrcBlock: 1, Dst: plan.G1, DstBlock: 12},
	}}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, []int64{10, 11}, failed)
	require.Equal(t, want, g.block(12))
}

func TestSetupErrors(t *testing.T) {
	_, err := New(Options{})
	require.ErrorContains(t, err, "DYN_KVBM_CPU_CACHE_GB")
	_, err = New(Options{HostBlocks: -1})
	require.Error(t, err)

	g := newG1(t, layout.FlashAttn)
	dir := t.TempDir()
	notDir := dir + "/file"
	require.NoError(t, os.WriteFile(notDir, nil, 0o600))
	w, err := New(Options{HostBlocks: 2, DiskBlocks: 2, DiskDir: notDir + "/sub"})
	require.NoError(t, err)
	require.ErrorContains(t, w.RegisterG1(g.e), "DYN_KVBM_DISK_CACHE_DIR")
	require.NoError(t, w.Close())

	w, err = New(Options{DiskBlocks: 1 << 40, DiskDir: dir})
	require.NoError(t, err)
	err = w.RegisterG1(g.e)
	require.ErrorContains(t, err, "disk tier needs")
	require.NoError(t, w.Close())

	w, err = New(Options{HostBlocks: 2})
	require.NoError(t, err)
	empty, err := (&plan.Step{Seq: 1}).Encode()
	require.NoError(t, err)
	require.ErrorContains(t, w.BindStep(empty), "not registered")
	require.NoError(t, w.RegisterG1(g.e))
	require.ErrorContains(t, w.RegisterG1(g.e), "already registered")
	require.ErrorContains(t, w.BindStep([]byte{0xc1}), "decode step")
	require.NoError(t, w.Close())
}

// TestODirectFallbacks: tmpfs and DYN_KVBM_DISK_DISABLE_O_DIRECT both work end to end.
func TestODirectFallbacks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		dir     string
		disable bool
	}{{"tmpfs", "/dev/shm", false}, {"disabled", t.TempDir(), true}} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := os.Stat(tc.dir); err != nil {
				t.Skip(tc.dir, err)
			}
			g := newG1(t, layout.TRTLLM)
			w := newWorker(t, g, Options{DiskBlocks: 3, DiskDir: tc.dir, DisableODirect: tc.disable})
			if tc.disable {
				require.False(t, w.diskFile.Direct())
			}
			want := g.block(4)
			run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{4}, plan.G3, []int64{2})})
			_, failed := run(t, w, &plan.Step{Seq: 2, Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G3, []int64{2}, plan.G1, []int64{0})}}})
			require.Empty(t, failed)
			require.Equal(t, want, g.block(0))
		})
	}
}

// TestSkippedPhasesRunAtNextBind: if the engine binds a new step without
// calling StartLoad/WaitForSave for the previous one, that work still happens.
func TestSkippedPhasesRunAtNextBind(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: 4})
	want := g.block(9)
	s1, err := (&plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{9}, plan.G2, []int64{0})}).Encode()
	require.NoError(t, err)
	require.NoError(t, w.BindStep(s1))
	loaded, failed := run(t, w, &plan.Step{Seq: 2, Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, []int64{0}, plan.G1, []int64{1})}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, want, g.block(1))
}

// TestLoadsOverlapSaves: a step's background loads run while its saves
// execute (as in an engine step); both land byte exact, race-free.
func TestLoadsOverlapSaves(t *testing.T) {
	g := newG1(t, layout.FlashInfer)
	w := newWorker(t, g, Options{HostBlocks: 24, MaxConcurrent: 4, BatchSize: 1})
	first := []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}
	want := make([][]byte, 0, 20)
	for _, b := range first {
		want = append(want, g.block(b))
	}
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, first, plan.G2, first)})
	second := []int64{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}
	for _, b := range second {
		want = append(want, g.block(b))
	}
	targets := []int64{30, 31, 32, 33, 34, 35, 36, 37, 38, 39}
	require.NoError(t, w.Bind(&plan.Step{Seq: 2,
		Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, first, plan.G1, targets)}},
		Saves: copies(plan.G1, second, plan.G2, second)}))
	w.StartLoad()
	w.WaitForSave()
	w.WaitLoads()
	loaded, failed := w.Finished()
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	for i, b := range targets {
		require.Equal(t, want[i], g.block(b))
	}
	targets2 := []int64{20, 21, 22, 23, 24, 25, 26, 27, 28, 29}
	_, failed = run(t, w, &plan.Step{Seq: 3, Loads: []plan.Load{{ReqID: "s", Copies: copies(plan.G2, second, plan.G1, targets2)}}})
	require.Empty(t, failed)
	for i, b := range targets2 {
		require.Equal(t, want[10+i], g.block(b))
	}
}
