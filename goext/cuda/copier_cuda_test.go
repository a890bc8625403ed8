//go:build cuda

package cuda

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/worker"
)

// These tests need a GPU: they build only with -tags cuda and each one
// skips (t.Skip, visible with -v, and counted at the end) when the driver
// reports no device.

var (
	testCtx  cu.CUContext
	noDevice string // why the tests skip; "" with a device
	skipped  atomic.Int64
)

func TestMain(m *testing.M) {
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		noDevice = fmt.Sprintf("no CUDA device (%d devices, err %v)", n, err)
	} else {
		dev, err := cu.GetDevice(0)
		if err == nil {
			testCtx, err = dev.RetainPrimaryCtx()
		}
		if err != nil {
			fmt.Println("cuda:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	if n := skipped.Load(); n > 0 {
		fmt.Printf("goext/cuda: %d tests/benchmarks SKIPPED: %s\n", n, noDevice)
	}
	os.Exit(code)
}

// needGPU skips t when there is no CUDA device.
func needGPU(t testing.TB) {
	t.Helper()
	if noDevice != "" {
		skipped.Add(1)
		t.Skip(noDevice)
	}
}

// onCtx runs fn with device 0's primary context current.
func onCtx(t testing.TB, fn func() error) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	require.NoError(t, cu.PushCurrentCtx(testCtx))
	defer func() { _, _ = cu.PopCurrentCtx() }()
	require.NoError(t, fn())
}

// gpuCache is an engine KV cache in device memory: tensors of one shape.
type gpuCache struct {
	ptrs  []cu.DevicePtr
	bytes int64
	eng   *layout.Engine
}

func newCache(t *testing.T, kind layout.Kind, tensors int, shape []int64, numBlocks, blockSize, dtype int) *gpuCache {
	return newCacheIn(t, kind, tensors, shape, numBlocks, blockSize, dtype, nil)
}

// newCacheIn is newCache with every tensor carved out of one allocation,
// gaps[i] bytes before tensor i, when gaps is not nil (nil: one allocation
// per tensor).
func newCacheIn(t *testing.T, kind layout.Kind, tensors int, shape []int64, numBlocks, blockSize, dtype int, gaps []int64) *gpuCache {
	n := int64(dtype)
	for _, d := range shape {
		n *= d
	}
	g := &gpuCache{bytes: n}
	spec := layout.Spec{Kind: kind, NumBlocks: numBlocks, BlockSize: blockSize, DtypeBytes: dtype}
	rng := rand.New(rand.NewPCG(uint64(n), uint64(tensors)))
	onCtx(t, func() error {
		var arena cu.DevicePtr
		var off int64
		if gaps != nil {
			total := int64(tensors) * n
			for _, gap := range gaps {
				total += gap
			}
			var err error
			if arena, err = cu.MemAlloc(total); err != nil {
				return err
			}
			g.ptrs = append(g.ptrs, arena) // freed once, in Cleanup
		}
		for i := 0; i < tensors; i++ {
			var p cu.DevicePtr
			if gaps != nil {
				off += gaps[i]
				p = arena + cu.DevicePtr(off)
				off += n
			} else {
				var err error
				if p, err = cu.MemAlloc(n); err != nil {
					return err
				}
				g.ptrs = append(g.ptrs, p)
			}
			buf := make([]byte, n)
			for j := range buf {
				buf[j] = byte(rng.Uint32())
			}
			if err := cu.MemcpyHtoD(p, unsafe.Pointer(&buf[0]), n); err != nil {
				return err
			}
			spec.Tensors = append(spec.Tensors, layout.Tensor{Ptr: uintptr(p), Shape: shape})
		}
		return nil
	})
	t.Cleanup(func() {
		onCtx(t, func() error {
			for _, p := range g.ptrs {
				_ = cu.MemFree(p)
			}
			return nil
		})
	})
	var err error
	g.eng, err = layout.NewEngine(spec)
	require.NoError(t, err)
	return g
}

// block reads G1 block b (host layout) back from the device.
func (g *gpuCache) block(t *testing.T, b int) []byte {
	e := g.eng
	h := e.Host()
	out := make([]byte, e.BytesPerBlock())
	onCtx(t, func() error {
		for l := 0; l < e.NumLayers; l++ {
			for o := 0; o < e.OuterDim; o++ {
				off := h.ChunkOffset(l, o)
				if err := cu.MemcpyDtoH(unsafe.Pointer(&out[off]), cu.DevicePtr(e.ChunkAddr(b, l, o)), e.ChunkBytes); err != nil {
					return err
				}
			}
		}
		return nil
	})
	return out
}

type layoutCase struct {
	name   string
	kind   layout.Kind
	n      int // tensors
	shape  []int64
	blocks int
	bs     int
	dtype  int
}

// Small stand-ins for the real layouts (32 KiB chunks in production): 4
// layers, 16-token blocks, 2 KV heads × 64, bf16 → 4 KiB chunks.
var layouts = []layoutCase{
	{"flash_attn", layout.FlashAttn, 4, []int64{2, 96, 16, 2, 64}, 96, 16, 2},
	{"flashinfer", layout.FlashInfer, 4, []int64{96, 2, 16, 2, 64}, 96, 16, 2},
	{"trtllm", layout.TRTLLM, 1, []int64{96, 4, 2, 2 * 16 * 64}, 96, 16, 2},
	// vLLM's MLA backends: one latent per token and layer (72 here, 576 in
	// DeepSeek's), no K/V split.
	{"mla", layout.MLA, 4, []int64{96, 16, 72}, 96, 16, 2},
	// vLLM 0.32's per-layer view on every platform: [N, heads, bs, 2 × head_dim].
	{"cpu_paged", layout.CPUPaged, 4, []int64{96, 2, 16, 128}, 96, 16, 2},
	// 30-byte chunks: the unaligned (byte) kernel.
	{"flash_attn_unaligned", layout.FlashAttn, 3, []int64{2, 96, 3, 1, 5}, 96, 3, 2},
}

func modesFor(c *Copier) []Mode {
	ms := []Mode{Kernel, Staged}
	if c.contiguousBlocks() {
		ms = append(ms, Direct)
	}
	if batchInit() == nil {
		ms = append(ms, Batch, Split)
	}
	return ms
}

func TestDeviceOf(t *testing.T) {
	needGPU(t)
	g := newCache(t, layout.FlashAttn, 1, []int64{2, 8, 16, 2, 64}, 8, 16, 2)
	ord, err := DeviceOf(uintptr(g.ptrs[0]) + 100)
	require.NoError(t, err)
	require.Equal(t, 0, ord)
	host := make([]byte, 64)
	ord, err = DeviceOf(uintptr(unsafe.Pointer(&host[0])))
	require.NoError(t, err)
	require.Equal(t, -1, ord)
}

func TestParseMode(t *testing.T) {
	for s, want := range map[string]Mode{"": Auto, "auto": Auto, "kernel": Kernel, "STAGED": Staged, "direct": Direct, "batch": Batch, "Split": Split} {
		got, err := ParseMode(s)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err := ParseMode("memcpy")
	require.ErrorContains(t, err, "DYN_KVBM_CUDA_COPY")
}

// TestAutoMode: Split with no fixed share for every layout when the driver
// has the batched copies (its batch share one pitched copy per block where
// the layers are equally spaced), Staged otherwise; and the DMA streams'
// defaults.
func TestAutoMode(t *testing.T) {
	needGPU(t)
	want := Staged
	if batchInit() == nil {
		want = Split
	}
	for _, tc := range []struct {
		name    string
		kind    layout.Kind
		n       int
		shape   []int64
		gaps    []int64
		pitched bool
	}{
		// TensorRT-LLM, 2 layers × K/V × 16 KiB chunks: one 64 KiB piece a block.
		{"trtllm", layout.TRTLLM, 1, []int64{8, 2, 2, 16 * 8 * 64}, nil, false},
		// FlashAttention, the layers not whole K/V planes apart (4 KiB
		// more), so no pitched copy.
		{"flash_attn_uneven", layout.FlashAttn, 2, []int64{2, 8, 16, 16, 64}, []int64{0, 4096}, false},
		// The same layout with its layers back to back: one pitched copy a block.
		{"flash_attn_packed", layout.FlashAttn, 2, []int64{2, 8, 16, 16, 64}, []int64{0, 0}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var g *gpuCache
			if tc.gaps == nil {
				g = newCache(t, tc.kind, tc.n, tc.shape, 8, 16, 2)
			} else {
				g = newCacheIn(t, tc.kind, tc.n, tc.shape, 8, 16, 2, tc.gaps)
			}
			c, err := New(g.eng, Options{})
			require.NoError(t, err)
			defer c.Close()
			require.Equal(t, want, c.Mode(), c.String())
			require.Len(t, c.lanes[1].dma, DefaultDMAStreams)
			require.Contains(t, c.String(), fmt.Sprintf("×%d,", DefaultStagedThreads))
			if want == Split {
				require.Len(t, c.lanes[1].bdma, DefaultSplitStreams)
				require.Equal(t, 0, c.opts.SplitPercent)
				require.Contains(t, c.String(), "no fixed share")
				require.Equal(t, tc.pitched && batch3DInit() == nil, c.pitched != nil, c.String())
				require.Equal(t, 2, c.depth)
			}
		})
	}
}

func TestDirectNeedsContiguousBlocks(t *testing.T) {
	needGPU(t)
	// Layers 4 KiB more than whole K/V planes apart: Direct cannot move a
	// block with one copy, and Auto does not pick it.
	g := newCacheIn(t, layout.FlashAttn, 2, []int64{2, 8, 16, 2, 64}, 8, 16, 2, []int64{0, 4096})
	_, err := New(g.eng, Options{Mode: Direct})
	require.ErrorContains(t, err, "contiguous")
	c, err := New(g.eng, Options{})
	require.NoError(t, err)
	require.NotEqual(t, Direct, c.Mode())
	require.NoError(t, c.Close())
}

// roundTrip offloads src G1 blocks and onboards them into dst G1 blocks
// through the worker, via G2 only or via G2 → G3, and checks every byte.
// While the copies run, another stream keeps rewriting the `busy` blocks.
func roundTrip(t *testing.T, g *gpuCache, c *Copier, viaDisk bool) {
	rng := rand.New(rand.NewPCG(7, uint64(c.mode)))
	perm := rng.Perm(g.eng.NumBlocks)
	const n = 40
	src, dst, busy := perm[:n], perm[n:2*n], perm[2*n:]
	want := make([][]byte, n)
	for i, b := range src {
		want[i] = g.block(t, b)
	}
	w, err := worker.New(worker.Options{HostBlocks: n + 8, DiskBlocks: n + 8, DiskDir: t.TempDir(), G1: c, BatchSize: 7})
	require.NoError(t, err)
	defer func() { require.NoError(t, w.Close()) }()
	require.NoError(t, w.RegisterG1(g.eng))

	// The concurrent writer: memsets of the busy blocks' chunks on its own stream.
	var stop atomic.Bool
	var wg sync.WaitGroup
	var writes atomic.Int64
	wg.Go(func() {
		onCtx(t, func() error {
			s, err := cu.MakeStream(cu.NonBlocking)
			if err != nil {
				return err
			}
			defer s.Destroy()
			for v := byte(0); !stop.Load(); v++ {
				for _, b := range busy {
					for l := 0; l < g.eng.NumLayers; l++ {
						for o := 0; o < g.eng.OuterDim; o++ {
							if err := cu.MemsetD8Async(cu.DevicePtr(g.eng.ChunkAddr(b, l, o)), v, g.eng.ChunkBytes, s); err != nil {
								return err
							}
						}
					}
				}
				if err := s.Synchronize(); err != nil {
					return err
				}
				writes.Add(1)
			}
			return nil
		})
	})
	defer func() { stop.Store(true); wg.Wait() }()

	save := &plan.Step{Seq: 1}
	for i, b := range src {
		save.Saves = append(save.Saves, plan.Copy{Src: plan.G1, SrcBlock: int64(b), Dst: plan.G2, DstBlock: int64(i + 3)})
	}
	require.NoError(t, w.Bind(save))
	w.WaitForSave()
	loadTier, off := plan.G2, 3
	if viaDisk {
		move := &plan.Step{Seq: 2}
		for i := range src {
			move.Moves = append(move.Moves, plan.Copy{Src: plan.G2, SrcBlock: int64(i + 3), Dst: plan.G3, DstBlock: int64(i + 5)})
			// Drop the G2 copy: the load below can only be served from disk.
			move.Drops = append(move.Drops, plan.Copy{Src: plan.G2, SrcBlock: int64(i + 3)})
		}
		// Drops apply at Bind, before the moves: move first, drop next step.
		drops := move.Drops
		move.Drops = nil
		require.NoError(t, w.Bind(move))
		w.WaitForSave()
		require.NoError(t, w.Bind(&plan.Step{Seq: 3, Drops: drops}))
		loadTier, off = plan.G3, 5
	}
	load := &plan.Step{Seq: 4}
	for i, b := range dst {
		load.Loads = append(load.Loads, plan.Load{ReqID: fmt.Sprint("r", i),
			Copies: []plan.Copy{{Src: loadTier, SrcBlock: int64(i + off), Dst: plan.G1, DstBlock: int64(b)}}})
	}
	require.NoError(t, w.Bind(load))
	w.StartLoad()
	w.WaitLoads()
	loaded, failed := w.Finished()
	require.Len(t, loaded, n)
	require.Empty(t, failed)
	for i, b := range dst {
		if got := g.block(t, b); !bytes.Equal(want[i], got) {
			t.Fatalf("G1 block %d (from block %d): bytes differ", b, src[i])
		}
	}
	// The source blocks were never written by anyone.
	for i, b := range src {
		require.True(t, bytes.Equal(want[i], g.block(t, b)), "source block %d changed", b)
	}
}

func TestRoundTrip(t *testing.T) {
	needGPU(t)
	for _, lc := range layouts {
		for _, viaDisk := range []bool{false, true} {
			g := newCache(t, lc.kind, lc.n, lc.shape, lc.blocks, lc.bs, lc.dtype)
			probe, err := New(g.eng, Options{})
			require.NoError(t, err)
			modes := modesFor(probe)
			require.NoError(t, probe.Close())
			for _, m := range modes {
				name := fmt.Sprintf("%s/%s/g2", lc.name, m)
				if viaDisk {
					name = fmt.Sprintf("%s/%s/g3", lc.name, m)
				}
				t.Run(name, func(t *testing.T) {
					// A small staging buffer forces several sub-batches
					// (Staged: 4 one-block slots, each reused many times).
					c, err := New(g.eng, Options{Mode: m, StagingBytes: 3 * g.eng.BytesPerBlock(), MaxBatch: 16})
					require.NoError(t, err)
					roundTrip(t, g, c, viaDisk)
				})
				if m == Staged {
					t.Run(name+"/depth2x3", func(t *testing.T) {
						// 3 DMA streams over 2 slots: a slot's DMA copies
						// change stream from one use to the next.
						c, err := New(g.eng, Options{Mode: m, PipelineDepth: 2, StagingBytes: 6 * g.eng.BytesPerBlock(), StagedCTAs: 1, StagedThreads: 32, DMAStreams: 3, StagedLowPriority: true})
						require.NoError(t, err)
						roundTrip(t, g, c, viaDisk)
					})
				}
				if m == Split {
					// Shared in pieces of one or two blocks: each side
					// comes back many times and every event is reused;
					// and a fixed share.
					for _, o := range []Options{{SplitChunkBytes: g.eng.BytesPerBlock()}, {SplitChunkBytes: 2 * g.eng.BytesPerBlock(), PipelineDepth: 3}, {SplitPercent: 30}} {
						t.Run(fmt.Sprintf("%s/chunk%d/pct%d", name, o.SplitChunkBytes/g.eng.BytesPerBlock(), o.SplitPercent), func(t *testing.T) {
							o.Mode, o.StagingBytes, o.MaxBatch = m, 3*g.eng.BytesPerBlock(), 16
							c, err := New(g.eng, o)
							require.NoError(t, err)
							roundTrip(t, g, c, viaDisk)
						})
					}
					for _, busy := range []struct {
						name string
						fn   func(int) bool
					}{{"busy", func(int) bool { return true }}, {"busy-idle", func(j int) bool { return j%3 == 1 }}} {
						t.Run(name+"/"+busy.name, func(t *testing.T) {
							// As while the engine's kernels hold the SMs
							// (one one-block staged chunk at a time, the
							// batched copies on every stream), and as
							// when the GPU turns busy and idle again:
							// chunks of one and of two blocks in turn, so
							// chunks wrap around the staging ring.
							c, err := New(g.eng, Options{Mode: m, StagingBytes: 6 * g.eng.BytesPerBlock(), PipelineDepth: 3, SplitChunkBytes: 2 * g.eng.BytesPerBlock(), MaxBatch: 16})
							require.NoError(t, err)
							c.testBusy = busy.fn
							roundTrip(t, g, c, viaDisk)
							require.Contains(t, c.String(), "so far")
							// While busy, blocks that are one range of G1
							// go by one plain copy each.
							require.Equal(t, c.contig, strings.Contains(c.String(), "cuMemcpyAsync, one copy per block"), c.String())
							if busy.name == "busy" {
								require.Equal(t, c.contig, c.sharedPlain.Load() > 0, c.String())
							}
						})
					}
					t.Run(name+"/busy-batch", func(t *testing.T) {
						// KVBM_CUDA_SPLIT_BUSY=batch: the driver's batched
						// copy while busy, as before.
						c, err := New(g.eng, Options{Mode: m, StagingBytes: 6 * g.eng.BytesPerBlock(), PipelineDepth: 3, SplitChunkBytes: 2 * g.eng.BytesPerBlock(), MaxBatch: 16, SplitBusyBatch: true})
						require.NoError(t, err)
						c.testBusy = func(int) bool { return true }
						roundTrip(t, g, c, viaDisk)
						require.Positive(t, c.sharedBatch.Load())
						require.Zero(t, c.sharedPlain.Load())
						require.NotContains(t, c.String(), "one copy per block")
					})
					t.Run(name+"/busy-paced", func(t *testing.T) {
						// Busy all along, with a probe interval longer
						// than the test: each call sends one staged chunk
						// (1/splitBusyDiv of a slot, here one block) and
						// the batched copies move the rest.
						c, err := New(g.eng, Options{Mode: m, StagingBytes: 6 * g.eng.BytesPerBlock(), PipelineDepth: 3, SplitChunkBytes: 2 * g.eng.BytesPerBlock(), MaxBatch: 16, SplitProbe: time.Hour})
						require.NoError(t, err)
						c.testBusy = func(int) bool { return true }
						roundTrip(t, g, c, viaDisk)
						staged := c.sharedBlocks.Load() - c.sharedBatch.Load()
						require.Positive(t, c.sharedCalls.Load())
						require.LessOrEqual(t, staged, c.sharedCalls.Load(), "at most one one-block probe chunk per call")
					})
				}
				if m == Batch || m == Direct || m == Staged || m == Split {
					for _, ns := range []int{1, 5} {
						t.Run(fmt.Sprintf("%s/streams%d", name, ns), func(t *testing.T) {
							c, err := New(g.eng, Options{Mode: m, StagingBytes: 3 * g.eng.BytesPerBlock(), MaxBatch: 16, DMAStreams: ns})
							require.NoError(t, err)
							require.Len(t, c.lanes[0].dma, ns)
							roundTrip(t, g, c, viaDisk)
						})
					}
				}
			}
		}
	}
}

// TestPitched: with the layers' tensors equally spaced (carved out of one
// allocation, as they usually are), Batch and Split move a whole block with
// one pitched copy, byte-exact through G2 and G3, for FlashAttention's K/V
// planes and FlashInfer's adjacent K/V; with one layer out of step the
// copier keeps one copy per piece.
func TestPitched(t *testing.T) {
	needGPU(t)
	if batch3DInit() != nil {
		t.Skip("driver has no cuMemcpy3DBatchAsync")
	}
	cases := []struct {
		name  string
		kind  layout.Kind
		shape []int64
		gaps  []int64
		want  bool
	}{
		{"flash_attn", layout.FlashAttn, []int64{2, 96, 16, 2, 64}, []int64{0, 0, 0, 0}, true},
		{"flash_attn_spaced", layout.FlashAttn, []int64{2, 96, 16, 2, 64}, []int64{4096, 96 * 4096, 96 * 4096, 96 * 4096}, true},
		{"flashinfer", layout.FlashInfer, []int64{96, 2, 16, 2, 64}, []int64{0, 8192, 8192, 8192}, true},
		{"flash_attn_uneven", layout.FlashAttn, []int64{2, 96, 16, 2, 64}, []int64{0, 0, 4096, 0}, false},
		{"flashinfer_uneven", layout.FlashInfer, []int64{96, 2, 16, 2, 64}, []int64{0, 0, 0, 256}, false},
	}
	for _, tc := range cases {
		for _, m := range []Mode{Batch, Split} {
			for _, viaDisk := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/disk=%v", tc.name, m, viaDisk), func(t *testing.T) {
					g := newCacheIn(t, tc.kind, 4, tc.shape, 96, 16, 2, tc.gaps)
					c, err := New(g.eng, Options{Mode: m, StagingBytes: 3 * g.eng.BytesPerBlock(), MaxBatch: 16})
					require.NoError(t, err)
					require.Equal(t, tc.want, c.pitched != nil, c.String())
					require.Equal(t, tc.want, strings.Contains(c.String(), "one pitched copy per block"), c.String())
					roundTrip(t, g, c, viaDisk)
				})
			}
		}
	}
}

func TestBadOptions(t *testing.T) {
	needGPU(t)
	g := newCache(t, layout.FlashAttn, 2, []int64{2, 8, 16, 2, 64}, 8, 16, 2)
	_, err := New(g.eng, Options{StagedThreads: 48})
	require.ErrorContains(t, err, "KVBM_CUDA_STAGED_THREADS=48")
	_, err = New(g.eng, Options{DMAStreams: 9})
	require.ErrorContains(t, err, "KVBM_CUDA_DMA_STREAMS=9")
	_, err = New(g.eng, Options{Mode: Split, SplitStreams: 9})
	require.ErrorContains(t, err, "KVBM_CUDA_SPLIT_STREAMS=9")
	_, err = New(g.eng, Options{Mode: Split, SplitPercent: 100})
	require.ErrorContains(t, err, "KVBM_CUDA_SPLIT_PCT=100")
	c, err := New(g.eng, Options{Mode: Staged, StagedLowPriority: true})
	require.NoError(t, err)
	require.Contains(t, c.String(), "low priority")
	require.NoError(t, c.Close())
}

func TestUnregisteredHostBuffer(t *testing.T) {
	needGPU(t)
	g := newCache(t, layout.FlashAttn, 2, []int64{2, 8, 16, 2, 64}, 8, 16, 2)
	c, err := New(g.eng, Options{Mode: Kernel})
	require.NoError(t, err)
	defer c.Close()
	buf := make([]byte, g.eng.BytesPerBlock())
	require.ErrorContains(t, c.GatherBlocks([]int{1}, [][]byte{buf}), "not in a registered host region")
	require.ErrorContains(t, c.GatherBlocks([]int{8}, [][]byte{buf}), "out of range")
}

// TestCoalescedCopies: runs of blocks adjacent in host memory (and, for
// Direct, in G1) move as one DMA copy; the bytes must still land per block.
func TestCoalescedCopies(t *testing.T) {
	needGPU(t)
	for _, lc := range layouts[:3] {
		g := newCache(t, lc.kind, lc.n, lc.shape, lc.blocks, lc.bs, lc.dtype)
		probe, err := New(g.eng, Options{})
		require.NoError(t, err)
		modes := modesFor(probe)
		require.NoError(t, probe.Close())
		for _, m := range modes {
			t.Run(lc.name+"/"+m.String(), func(t *testing.T) {
				c, err := New(g.eng, Options{Mode: m, StagingBytes: 8 * g.eng.BytesPerBlock(), PipelineDepth: 2})
				require.NoError(t, err)
				defer c.Close()
				host, err := storage.NewHostRegion(24, g.eng.BytesPerBlock(), true)
				require.NoError(t, err)
				defer host.Close()
				require.NoError(t, c.RegisterHost(host))
				// Host slots: a run of 9, a gap, a run of 5 (crossing staging slots).
				slots := []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16}
				src := []int{10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 4, 40, 41}
				dst := []int{60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 80, 81}
				bufs := make([][]byte, len(slots))
				for i, s := range slots {
					bufs[i] = host.Block(s)
				}
				want := make([][]byte, len(src))
				for i, b := range src {
					want[i] = g.block(t, b)
				}
				require.NoError(t, c.GatherBlocks(src, bufs))
				for i := range bufs {
					require.True(t, bytes.Equal(want[i], bufs[i][:len(want[i])]), "host slot %d", slots[i])
				}
				require.NoError(t, c.ScatterBlocks(dst, bufs))
				for i, b := range dst {
					require.True(t, bytes.Equal(want[i], g.block(t, b)), "G1 block %d", b)
				}
			})
		}
	}
}

// TestRows: with two KV cache groups sharing each tensor (vLLM's hybrid
// manager: layers 0 and 1 in tensor A, 2 and 3 in tensor B, groups 0 and 1
// alternating), GatherRows reads layer l from the block of l's group, in the
// host layout transfer.GatherRows writes; ScatterRows writes layer l into the
// block of l's group and nothing else, leaving a group whose entry is the
// null block untouched. Every copy mode takes the same path.
func TestRows(t *testing.T) {
	needGPU(t)
	base := newCache(t, layout.FlashAttn, 2, []int64{2, 48, 16, 2, 64}, 48, 16, 2)
	shape := []int64{2, 48, 16, 2, 64}
	a, b := layout.Tensor{Ptr: base.eng.Base(0), Shape: shape}, layout.Tensor{Ptr: base.eng.Base(1), Shape: shape}
	e, err := layout.NewEngine(layout.Spec{Kind: layout.FlashAttn, Tensors: []layout.Tensor{a, a, b, b},
		NumBlocks: 48, BlockSize: 16, DtypeBytes: 2, LayerGroups: []int{0, 1, 0, 1}})
	require.NoError(t, err)
	g := &gpuCache{eng: e}
	// chunks reads G1 back per (tensor, block, outer), the unit two groups share.
	type key struct{ tensor, block, outer int }
	snapshot := func() map[key][]byte {
		out := map[key][]byte{}
		onCtx(t, func() error {
			for blk := 0; blk < e.NumBlocks; blk++ {
				for l := 0; l < e.NumLayers; l += 2 {
					for o := 0; o < e.OuterDim; o++ {
						buf := make([]byte, e.ChunkBytes)
						if err := cu.MemcpyDtoH(unsafe.Pointer(&buf[0]), cu.DevicePtr(e.ChunkAddr(blk, l, o)), e.ChunkBytes); err != nil {
							return err
						}
						out[key{l / 2, blk, o}] = buf
					}
				}
			}
			return nil
		})
		return out
	}
	h := e.Host()
	for _, mode := range []Mode{Kernel, Staged, Batch, Split} {
		t.Run(mode.String(), func(t *testing.T) {
			c, err := New(e, Options{Mode: mode})
			require.NoError(t, err)
			defer func() { require.NoError(t, c.Close()) }()
			region, err := storage.NewHostRegion(8, e.BytesPerBlock(), true)
			require.NoError(t, err)
			defer region.Close()
			require.NoError(t, c.RegisterHost(region))
			bufs := [][]byte{region.IOBlock(0), region.IOBlock(1), region.IOBlock(2)}
			rows := [][]int64{{3, 10}, {7, 11}, {40, 2}}
			require.NoError(t, c.GatherRows(rows, bufs))
			for i, r := range rows {
				for l := 0; l < e.NumLayers; l++ {
					for o := 0; o < e.OuterDim; o++ {
						off := h.ChunkOffset(l, o)
						want := g.block(t, int(r[e.LayerGroup(l)]))[off : off+e.ChunkBytes]
						require.Equal(t, want, bufs[i][off:off+e.ChunkBytes], "row %d layer %d outer %d", i, l, o)
					}
				}
			}

			rng := rand.New(rand.NewPCG(3, uint64(mode)))
			for _, buf := range bufs {
				for j := range buf {
					buf[j] = byte(rng.Uint32())
				}
			}
			before := snapshot()
			load := [][]int64{{20, 21}, {22, layout.NoBlock}, {23, 24}}
			require.NoError(t, c.ScatterRows(load, bufs))
			after := snapshot()
			written := map[key]bool{}
			for i, r := range load {
				for l := 0; l < e.NumLayers; l++ {
					blk := r[e.LayerGroup(l)]
					if blk == layout.NoBlock {
						continue
					}
					for o := 0; o < e.OuterDim; o++ {
						k := key{l / 2, int(blk), o}
						written[k] = true
						off := h.ChunkOffset(l, o)
						require.Equal(t, bufs[i][off:off+e.ChunkBytes], after[k], "row %d layer %d outer %d", i, l, o)
					}
				}
			}
			for k, v := range before {
				if !written[k] {
					require.Equal(t, v, after[k], "chunk %+v changed", k)
				}
			}
			require.ErrorContains(t, c.GatherRows([][]int64{{1, layout.NoBlock}}, bufs[:1]), "out of range")
			require.ErrorContains(t, c.GatherRows([][]int64{{1}}, bufs[:1]), "group row")
			require.ErrorContains(t, c.GatherRows([][]int64{{1, 2}}, [][]byte{make([]byte, e.BytesPerBlock())}), "not in a registered host region")
		})
	}
}

// TestRowsStateGroup: group 1 keeps recurrent state (layout.StateKind). A
// gather whose row has no state block stores the attention layers and
// zeros in the state layers (as transfer.GatherRows does), instead of
// refusing the row; an attention group without a block is still refused.
func TestRowsStateGroup(t *testing.T) {
	needGPU(t)
	base := newCache(t, layout.FlashAttn, 2, []int64{2, 48, 16, 2, 64}, 48, 16, 2)
	shape := []int64{2, 48, 16, 2, 64}
	a, b := layout.Tensor{Ptr: base.eng.Base(0), Shape: shape}, layout.Tensor{Ptr: base.eng.Base(1), Shape: shape}
	e, err := layout.NewEngine(layout.Spec{Kind: layout.FlashAttn, Tensors: []layout.Tensor{a, a, b, b},
		NumBlocks: 48, BlockSize: 16, DtypeBytes: 2, LayerGroups: []int{0, 1, 0, 1},
		GroupKinds: []string{"full_attention", layout.StateKind}})
	require.NoError(t, err)
	g := &gpuCache{eng: e}
	h := e.Host()
	for _, mode := range []Mode{Kernel, Batch, Split} {
		t.Run(mode.String(), func(t *testing.T) {
			c, err := New(e, Options{Mode: mode})
			require.NoError(t, err)
			defer func() { require.NoError(t, c.Close()) }()
			region, err := storage.NewHostRegion(4, e.BytesPerBlock(), true)
			require.NoError(t, err)
			defer region.Close()
			require.NoError(t, c.RegisterHost(region))
			bufs := [][]byte{region.IOBlock(0), region.IOBlock(1)}
			for _, buf := range bufs {
				for j := range buf {
					buf[j] = 0xA5 // stale bytes of an earlier block
				}
			}
			rows := [][]int64{{3, layout.NoBlock}, {7, 11}}
			require.NoError(t, c.GatherRows(rows, bufs))
			for i, r := range rows {
				for l := 0; l < e.NumLayers; l++ {
					for o := 0; o < e.OuterDim; o++ {
						off := h.ChunkOffset(l, o)
						want := make([]byte, e.ChunkBytes)
						if blk := r[e.LayerGroup(l)]; blk != layout.NoBlock {
							want = g.block(t, int(blk))[off : off+e.ChunkBytes]
						}
						require.Equal(t, want, bufs[i][off:off+e.ChunkBytes], "row %d layer %d outer %d", i, l, o)
					}
				}
			}
			require.ErrorContains(t, c.GatherRows([][]int64{{layout.NoBlock, 2}}, bufs[:1]), "out of range")
		})
	}
}
