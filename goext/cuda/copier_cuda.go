//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/storage"
)

// Mode is how a Copier moves per-layer layouts.
type Mode uint8

const (
	// Auto: Split (no fixed share) when the driver has the batched copies,
	// else DefaultMode.
	Auto Mode = iota
	// Kernel: one kernel per batch reads/writes mapped page-locked host
	// memory directly (zero-copy).
	Kernel
	// Staged: one kernel per staging-buffer load gathers into (scatters
	// from) device memory; one DMA copy per block crosses PCIe.
	Staged
	// Direct: one DMA copy per block; only for layouts whose blocks are one
	// contiguous range of G1 in the host layout's order.
	Direct
	// Batch: no kernel at all; every chunk (adjacent chunks merged) is one
	// copy of one cuMemcpyBatchAsync call (CUDA >= 12.8 driver, looked up at
	// run time). Experimental; where the driver lacks it, Staged is used.
	Batch
	// Split: each batch's blocks are shared between Batch (on DMA streams of
	// their own) and Staged. By default the share is not fixed but follows
	// the GPU (runShared): while the gather/scatter kernels run as soon as
	// they are queued (an idle GPU) the batch goes staged, the fastest way
	// across PCIe; while they wait for SMs (the engine's kernels hold
	// them) one small staged chunk stays in flight and the copy engines
	// alone move the rest, so the engine keeps its SMs. Where the driver
	// lacks cuMemcpyBatchAsync, Staged is used. Auto's pick.
	Split
)

// DefaultMode is what Auto picks where the driver lacks the batched copies
// that Split needs: Staged, whose PCIe traffic goes through the copy
// engines. The zero-copy Kernel mode moves the same bytes about as fast on
// an idle GPU, but its kernel holds every SM while it waits on PCIe: on an
// H200 an engine's bf16 matmul ran 92% slower while kvbm moved KV in Kernel
// mode, and a few percent slower in Staged mode (docs/cuda.md).
const DefaultMode = Staged

// DefaultDMAStreams is Options.DMAStreams' default for Staged and Direct
// (one per staging slot), DefaultBatchStreams for Batch. On an H200 a
// second DMA stream per direction let Staged move 87 GB/s both ways while
// the engine's matmuls ran instead of 75, and Batch over TensorRT-LLM's
// 2 MiB blocks reached 95 GB/s both ways on 4 streams instead of 89 on one
// (docs/cuda.md).
const (
	DefaultDMAStreams   = 2
	DefaultBatchStreams = 4
)

// DefaultStagedThreads is Options.StagedThreads' default. Thread blocks of
// 64 or 32 threads, which might share an SM with the engine's kernels,
// slowed an H200's matmuls as much as 256 (docs/cuda.md).
const DefaultStagedThreads = 256

// DefaultSplitStreams is Options.SplitStreams' default: the DMA streams per
// direction of Split's batch share (besides Options.DMAStreams for the
// staged share; with no fixed share, used while the GPU is busy);
// splitInFlight is how many of its sub-batches each of them holds queued
// while the share is not fixed; DefaultSplitChunk is Options.SplitChunkBytes'
// default. One stream, as torch's own copy uses: while the engine computes,
// four streams per direction cost an H100's matmuls 2.6–3.6 points more than
// torch's contiguous copy in paired windows, one stream moved as much and
// cost no more than torch's copy (docs/cuda.md).
const (
	DefaultSplitStreams = 1
	splitInFlight       = 2
	DefaultSplitChunk   = 32 << 20
	DefaultSplitProbe   = 2 * time.Millisecond
)

// Split with no fixed share (runShared): a gather/scatter kernel that
// waited longer than splitBusyWait for SMs marks the GPU busy, one that ran
// within splitIdleWait marks it idle; while it is busy the staged share
// keeps one chunk of 1/splitBusyDiv of a slot in flight.
const (
	splitBusyWait = 500 * time.Microsecond
	splitIdleWait = 250 * time.Microsecond
	splitBusyDiv  = 8
)

var modeNames = [...]string{Auto: "auto", Kernel: "kernel", Staged: "staged", Direct: "direct", Batch: "batch", Split: "split"}

func (m Mode) String() string {
	if int(m) < len(modeNames) {
		return modeNames[m]
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// ParseMode reads DYN_KVBM_CUDA_COPY ("" means auto).
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return Auto, nil
	case "kernel", "zerocopy", "zero_copy":
		return Kernel, nil
	case "staged":
		return Staged, nil
	case "direct":
		return Direct, nil
	case "batch":
		return Batch, nil
	case "split":
		return Split, nil
	}
	return Auto, fmt.Errorf("cuda: DYN_KVBM_CUDA_COPY=%q: want auto, kernel, staged, direct, batch or split", s)
}

// Options tune a Copier; zero values pick the defaults. The variables
// named below are read by goext/config (config.CUDA), never here.
type Options struct {
	Mode Mode
	// StagingBytes is the device staging buffer per direction in Staged
	// mode (default 128 MiB, at least one block per pipeline slot;
	// KVBM_CUDA_STAGING_MIB).
	StagingBytes int64
	// PipelineDepth splits the staging buffer into this many slots (default
	// 2; KVBM_CUDA_PIPELINE_DEPTH): while one slot's DMA copy crosses PCIe,
	// the next slot is gathered (offload) or scattered (onboard) by the kernel.
	PipelineDepth int
	// StagedCTAs is the fixed grid of the gather/scatter kernel in Staged
	// mode (default: one thread block per SM; KVBM_CUDA_STAGED_CTAS). A
	// device-to-device pass over a 64 MiB slot then takes tens of
	// microseconds, so it slips in between the engine's kernels.
	StagedCTAs int
	// StagedThreads is the thread-block size of the gather/scatter kernel
	// in Staged mode (default DefaultStagedThreads; KVBM_CUDA_STAGED_THREADS,
	// 32..256, a multiple of 32).
	StagedThreads int
	// StagedLowPriority runs the gather/scatter kernel on a stream of the
	// lowest priority instead of the highest (KVBM_CUDA_STAGED_PRIORITY=low):
	// its thread blocks then start only where the engine's kernels leave
	// SMs idle, typically the last wave of a kernel.
	StagedLowPriority bool
	// DMAStreams is how many DMA streams each direction spreads its copies
	// over (default DefaultDMAStreams, for Batch DefaultBatchStreams;
	// KVBM_CUDA_DMA_STREAMS, at most 8). Batch splits a
	// batch's copies between them, Staged and Direct alternate them; the
	// driver can then run a direction's copies on more than one copy
	// engine, so per-copy overhead overlaps and one busy engine does not
	// hold up the other direction.
	DMAStreams int
	// SplitPercent fixes the share (1–99 %) of a Split batch's blocks that
	// goes by Batch, the rest by Staged (KVBM_CUDA_SPLIT_PCT). Zero (the
	// default): no fixed share, each side takes more while the other is busy.
	SplitPercent int
	// SplitChunkBytes is how much of the batch Split's batch share takes at a
	// time while the share is not fixed (default DefaultSplitChunk;
	// KVBM_CUDA_SPLIT_CHUNK_MIB).
	SplitChunkBytes int64
	// SplitStreams is how many DMA streams per direction Split's batch share
	// uses (default DefaultSplitStreams; KVBM_CUDA_SPLIT_STREAMS, at most 8).
	SplitStreams int
	// SplitProbe is the least time between two staged chunks while Split
	// (no fixed share) finds the GPU busy (default DefaultSplitProbe;
	// KVBM_CUDA_SPLIT_PROBE_US): each such chunk's gather/scatter kernel
	// takes the SMs between two of the engine's kernels, and is only there to
	// see when the GPU is idle again.
	SplitProbe time.Duration
	// SplitBusyBatch sends Split's batch share (no fixed share: the copies
	// made while the GPU is busy) through the driver's batched copy for
	// every layout (KVBM_CUDA_SPLIT_BUSY=batch). By default, where a G1
	// block is one range (TensorRT-LLM), that share goes as one plain DMA
	// copy per block, as Direct: on an H100 the batched copies of such
	// blocks cost the engine's matmuls +0.3 to +2.9 points against torch's
	// contiguous copy in paired windows, plain copies −1.3 to +0.7, as
	// torch's own per-block copies do (docs/cuda.md). vLLM's blocks (one
	// pitched copy each) stay batched: one cuMemcpy3DAsync per block cost
	// as much as the batched pitched copies.
	SplitBusyBatch bool
	// CTAsPerSM sizes the Kernel-mode grid (default 4 thread blocks per SM).
	CTAsPerSM int
	// MaxBatch is the most blocks the worker hands over per call (default 8192).
	MaxBatch int
	// KernelsFile, when set, loads the kernels from this cubin/fatbin/PTX
	// file instead of the ones compiled into the library (KVBM_CUDA_KERNELS).
	KernelsFile string
}

// region is page-locked host memory the copier may copy to and from.
type region struct {
	host, dev uintptr // host address and its device-mapped alias
	size      int64
	owned     bool // allocated by us (cuMemHostAlloc), not registered
}

// lane is one direction's streams and scratch memory; its mutex serialises
// the calls of that direction.
type lane struct {
	mu     sync.Mutex  // guards the fields below, to the end of the struct
	stream cu.Stream   // DMA copies (and the Kernel mode's work); dma[0]
	dma    []cu.Stream // every DMA stream of the direction, stream first
	// Staged mode: the gather/scatter kernels run on kstream (highest
	// priority, so its few thread blocks get SMs ahead of the engine's
	// queued work); kDone[s]/dDone[s] mark the kernel's and the DMA's last
	// use of staging slot s.
	kstream      cu.Stream
	kDone, dDone []cu.Event
	descCap      int     // entries the descriptor buffers hold
	descH        uintptr // page-locked host descriptors: [ids n][addrs n] uint64
	descD        cu.DevicePtr
	staging      cu.DevicePtr // Staged mode
	// Split mode: the batch share's DMA streams (the staged share uses dma)
	// and, per stream, the events that mark its queued sub-batches' ends;
	// busy carries runShared's view of the GPU from one call to the next.
	bdma  []cu.Stream
	bDone [][]cu.Event
	busy  bool // runShared: the engine's kernels kept the last staged kernel waiting
}

// Copier implements worker.G1Copier for GPU-resident engine tensors.
type Copier struct {
	eng          *layout.Engine
	opts         Options
	mode         Mode
	dev          cu.Device
	ordinal      int
	ctx          cu.CUContext
	mod          cu.Module
	fnVec, fnB1  cu.Function
	grid         int
	stagedGrid   int
	bases        cu.DevicePtr // NumLayers uint64: G1 address of chunk (0, l, 0)
	blockStride  int64
	outerStride  int64
	vecOK        bool // G1 addresses and chunk size are 16-byte multiples
	bpb          int64
	batchNote    string   // why Batch fell back to Staged
	pitched      *pitch   // Batch/Split: one pitched copy per block (pitchOf); nil: one copy per piece
	contig       bool     // each G1 block is one range in host order (contiguousBlocks)
	hostOff      []int64  // Batch: host-layout offset of chunk (layer, outer)
	stagingSlots int      // blocks per staging slot
	depth        int      // staging slots
	lanes        [2]*lane // 0: G1 → host, 1: host → G1

	engineStream atomic.Uintptr // the engine's CUDA stream (0: legacy default stream)
	// Split with no fixed share: blocks moved, and how many of them by Batch.
	sharedBlocks, sharedBatch atomic.Int64
	sharedPlain               atomic.Int64         // of sharedBatch, moved by one plain copy per block (plainWhileBusy)
	sharedCalls               atomic.Int64         // runShared calls (tests)
	testBusy                  func(chunk int) bool // tests: whether runShared treats the GPU as busy before chunk
	closed                    atomic.Bool

	fenceMu sync.Mutex // guards fenceEv
	fenceEv cu.Event

	regMu   sync.RWMutex // guards regions
	regions []region
}

// New prepares a copier for e's tensors, which must all live on one GPU.
func New(e *layout.Engine, opts Options) (c *Copier, err error) {
	ord, err := DeviceOf(e.Base(0))
	if err != nil {
		return nil, err
	}
	if ord < 0 {
		return nil, fmt.Errorf("cuda: KV tensor 0 at %#x is not GPU memory", e.Base(0))
	}
	for i := 1; i < e.Tensors(); i++ {
		o, err := DeviceOf(e.Base(i))
		if err != nil {
			return nil, err
		}
		if o != ord {
			return nil, fmt.Errorf("cuda: KV tensor %d is on device %d, tensor 0 on device %d; one worker serves one GPU", i, o, ord)
		}
	}
	if opts.SplitStreams > 8 {
		return nil, fmt.Errorf("cuda: KVBM_CUDA_SPLIT_STREAMS=%d: want 1 to 8", opts.SplitStreams)
	}
	if opts.SplitStreams <= 0 {
		opts.SplitStreams = DefaultSplitStreams
	}
	if p := opts.SplitPercent; p < 0 || p > 99 {
		return nil, fmt.Errorf("cuda: KVBM_CUDA_SPLIT_PCT=%d: want 1 to 99", p)
	}
	if opts.SplitChunkBytes <= 0 {
		opts.SplitChunkBytes = DefaultSplitChunk
	}
	if opts.SplitProbe <= 0 {
		opts.SplitProbe = DefaultSplitProbe
	}
	if t := opts.StagedThreads; t != 0 && (t < 32 || t > 256 || t%32 != 0) {
		return nil, fmt.Errorf("cuda: KVBM_CUDA_STAGED_THREADS=%d: want a multiple of 32 in [32, 256]", t)
	}
	if opts.StagedThreads <= 0 {
		opts.StagedThreads = DefaultStagedThreads
	}
	if opts.DMAStreams > 8 {
		return nil, fmt.Errorf("cuda: KVBM_CUDA_DMA_STREAMS=%d: want 1 to 8", opts.DMAStreams)
	}
	if opts.StagingBytes <= 0 {
		opts.StagingBytes = 128 << 20
	}
	if opts.CTAsPerSM <= 0 {
		opts.CTAsPerSM = 4
	}
	if opts.PipelineDepth <= 0 {
		opts.PipelineDepth = 2
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 8192
	}
	dev, err := cu.GetDevice(ord)
	if err != nil {
		return nil, fmt.Errorf("cuda: device %d: %w", ord, err)
	}
	c = &Copier{eng: e, opts: opts, dev: dev, ordinal: ord, bpb: e.BytesPerBlock()}
	c.analyse()
	c.contig = c.contiguousBlocks()
	switch {
	case opts.Mode == Direct && !c.contig:
		return nil, fmt.Errorf("cuda: DYN_KVBM_CUDA_COPY=direct needs blocks contiguous in G1 (TensorRT-LLM layout); %v is not", e)
	case opts.Mode == Auto:
		// Split moves a batch like Staged while the GPU is idle (96–99% of
		// torch's contiguous copy on an H200) and with the copy engines
		// alone while the engine's kernels hold the SMs (its matmuls then
		// ran 0–3% slower, as with torch's own copy, against Staged's
		// 3–5%), for every layout (docs/cuda.md).
		c.mode = DefaultMode
		if batchInit() == nil {
			c.mode = Split
		}
	default:
		c.mode = opts.Mode
	}
	if c.opts.DMAStreams <= 0 {
		c.opts.DMAStreams = DefaultDMAStreams
		if c.mode == Batch {
			c.opts.DMAStreams = DefaultBatchStreams
		}
	}
	opts = c.opts
	c.depth = opts.PipelineDepth
	c.stagingSlots = int(max(1, opts.StagingBytes/int64(c.depth)/c.bpb))

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if c.ctx, err = c.dev.RetainPrimaryCtx(); err != nil {
		return nil, fmt.Errorf("cuda: retain primary context of device %d: %w", ord, err)
	}
	if err := cu.PushCurrentCtx(c.ctx); err != nil {
		_ = c.dev.ReleasePrimaryCtx()
		return nil, fmt.Errorf("cuda: make device %d's primary context current: %w", ord, err)
	}
	defer func() {
		_, _ = cu.PopCurrentCtx()
		if err != nil {
			c.release()
			_ = c.dev.ReleasePrimaryCtx()
		}
	}()
	if err = c.loadKernels(); err != nil {
		return nil, err
	}
	if c.mode == Batch || c.mode == Split {
		if berr := batchInit(); berr != nil {
			c.mode, c.batchNote = Staged, fmt.Sprintf(" (%s unavailable: %v)", c.mode, berr)
		}
		for l := 0; l < e.NumLayers; l++ {
			for o := 0; o < e.OuterDim; o++ {
				c.hostOff = append(c.hostOff, e.Host().ChunkOffset(l, o))
			}
		}
		if p, ok := c.pitchOf(); ok && c.mode != Staged && batch3DInit() == nil {
			c.pitched = &p
		}
	}
	sms, err := c.dev.Attribute(cu.MultiprocessorCount)
	if err != nil {
		return nil, fmt.Errorf("cuda: multiprocessor count: %w", err)
	}
	c.grid = sms * opts.CTAsPerSM
	c.stagedGrid = opts.StagedCTAs
	if c.stagedGrid <= 0 {
		c.stagedGrid = sms
	}
	least, greatest, err := cu.StreamPriorityRange()
	if err != nil {
		return nil, fmt.Errorf("cuda: stream priority range: %w", err)
	}
	kprio := greatest
	if opts.StagedLowPriority {
		kprio = least
	}
	if c.fenceEv, err = cu.MakeEvent(cu.DisableTiming); err != nil {
		return nil, fmt.Errorf("cuda: create event: %w", err)
	}
	for i := range c.lanes {
		l := &lane{}
		c.lanes[i] = l
		for range opts.DMAStreams {
			s, err := cu.MakeStream(cu.NonBlocking)
			if err != nil {
				return nil, fmt.Errorf("cuda: create stream: %w", err)
			}
			l.dma = append(l.dma, s)
		}
		l.stream = l.dma[0]
		if c.mode == Split {
			for range opts.SplitStreams {
				s, err := cu.MakeStream(cu.NonBlocking)
				if err != nil {
					return nil, fmt.Errorf("cuda: create stream: %w", err)
				}
				l.bdma = append(l.bdma, s)
				evs := make([]cu.Event, splitInFlight)
				for k := range evs {
					if evs[k], err = cu.MakeEvent(cu.DisableTiming); err != nil {
						return nil, fmt.Errorf("cuda: create event: %w", err)
					}
				}
				l.bDone = append(l.bDone, evs)
			}
		}
		if l.kstream, err = cu.MakeStreamWithPriority(kprio, cu.NonBlocking); err != nil {
			return nil, fmt.Errorf("cuda: create kernel stream: %w", err)
		}
		for range c.depth {
			var k, d cu.Event
			if k, err = cu.MakeEvent(cu.DisableTiming); err == nil {
				l.kDone = append(l.kDone, k)
				if d, err = cu.MakeEvent(cu.DisableTiming); err == nil {
					l.dDone = append(l.dDone, d)
				}
			}
			if err != nil {
				return nil, fmt.Errorf("cuda: create event: %w", err)
			}
		}
	}
	bases := make([]uint64, e.NumLayers)
	for l := range bases {
		bases[l] = uint64(e.ChunkAddr(0, l, 0))
	}
	if c.bases, err = cu.MemAlloc(int64(8 * len(bases))); err != nil {
		return nil, fmt.Errorf("cuda: allocate %d layer addresses: %w", len(bases), err)
	}
	if err = cu.MemcpyHtoD(c.bases, unsafe.Pointer(&bases[0]), int64(8*len(bases))); err != nil {
		return nil, fmt.Errorf("cuda: upload layer addresses: %w", err)
	}
	return c, nil
}

// analyse derives the strides the kernel needs from the layout's chunk
// addresses (every layout is base(layer) + block·blockStride + outer·outerStride).
func (c *Copier) analyse() {
	e := c.eng
	base := e.ChunkAddr(0, 0, 0)
	if e.NumBlocks > 1 {
		c.blockStride = int64(e.ChunkAddr(1, 0, 0) - base)
	}
	if e.OuterDim > 1 {
		c.outerStride = int64(e.ChunkAddr(0, 0, 1) - base)
	}
	c.vecOK = e.ChunkBytes%16 == 0 && c.blockStride%16 == 0 && c.outerStride%16 == 0
	for l := 0; l < e.NumLayers; l++ {
		c.vecOK = c.vecOK && e.ChunkAddr(0, l, 0)%16 == 0
	}
}

// pitchOf reports whether one pitched (3D) copy can move a whole block: the
// layers' tensors equally spaced in ascending order (vLLM allocates one
// tensor per layer; the CUDA caching allocator left them unevenly spaced on
// an H200, KVBM_CUDA_PACK_KV_CACHE's pool ascending), the block's pieces of a layer either one
// run (FlashInfer: K and V adjacent) or OuterDim runs equally spaced (vLLM
// FlashAttention: K and V planes), and the host layout layer-major. On an
// H200 one such copy per 2 MiB block ran at 91–93% of a contiguous copy,
// against 61–95% (varying run to run) for one copy per 32 KiB piece
// (docs/cuda.md, bench/cuda/batch3d.cu). Blocks that are one contiguous
// range (TensorRT-LLM) need no pitch: the plain batch merges them.
func (c *Copier) pitchOf() (pitch, bool) {
	e := c.eng
	if c.contig || e.NumLayers < 1 || e.OuterDim < 1 {
		return pitch{}, false
	}
	cb := uint64(e.ChunkBytes)
	h := e.Host()
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			if h.ChunkOffset(l, o) != int64(uint64(l*e.OuterDim+o)*cb) {
				return pitch{}, false
			}
		}
	}
	base := e.ChunkAddr(0, 0, 0)
	var layer uint64 // bytes between layers in G1
	if e.NumLayers > 1 {
		a := e.ChunkAddr(0, 1, 0)
		if a <= base {
			return pitch{}, false
		}
		layer = uint64(a - base)
		for l := 2; l < e.NumLayers; l++ {
			if e.ChunkAddr(0, l, 0) != base+uintptr(uint64(l)*layer) {
				return pitch{}, false
			}
		}
	}
	if e.OuterDim == 1 || c.outerStride == e.ChunkBytes {
		// One run of OuterDim chunks per layer: rows are layers.
		w := uint64(e.OuterDim) * cb
		p := pitch{width: w, height: uint64(e.NumLayers), depth: 1, g1Row: layer, g1Layer: uint64(e.NumLayers)}
		if e.NumLayers == 1 {
			p.g1Row = w
		}
		return p, p.g1Row >= w
	}
	// OuterDim runs per layer, outerStride apart: rows are K/V, layers are
	// 3D layers, which needs the layer spacing to be whole rows.
	if c.outerStride < e.ChunkBytes {
		return pitch{}, false
	}
	row := uint64(c.outerStride)
	p := pitch{width: cb, height: uint64(e.OuterDim), depth: uint64(e.NumLayers), g1Row: row, g1Layer: uint64(e.OuterDim)}
	if e.NumLayers > 1 {
		if layer%row != 0 || layer/row < uint64(e.OuterDim) {
			return pitch{}, false
		}
		p.g1Layer = layer / row
	}
	return p, true
}

// contiguousBlocks reports whether each G1 block is one range in host order.
func (c *Copier) contiguousBlocks() bool {
	e, h := c.eng, c.eng.Host()
	base := e.ChunkAddr(0, 0, 0)
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			if int64(e.ChunkAddr(0, l, o)-base) != h.ChunkOffset(l, o) {
				return false
			}
		}
	}
	return true
}

func (c *Copier) loadKernels() error {
	var images []string
	src := "compiled-in kernels"
	if c.opts.KernelsFile != "" {
		b, err := os.ReadFile(c.opts.KernelsFile)
		if err != nil {
			return fmt.Errorf("cuda: KVBM_CUDA_KERNELS: %w", err)
		}
		images, src = []string{string(b)}, c.opts.KernelsFile
	} else {
		for _, im := range []string{kernelFatbin, kernelPTX} {
			if im != "" {
				images = append(images, im)
			}
		}
	}
	if len(images) == 0 {
		return errors.New("cuda: this library was built without compiled kernels (run kernels/build.sh on a machine with nvcc, then go run kernels/gen.go)")
	}
	var errs []error
	for _, im := range images {
		// cuModuleLoadData needs a NUL-terminated image when it is PTX text.
		mod, err := cu.LoadData(im + "\x00")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		fv, err1 := mod.Function("kvbm_copy_chunks_v16")
		fb, err2 := mod.Function("kvbm_copy_chunks_b1")
		if err := errors.Join(err1, err2); err != nil {
			_ = mod.Unload()
			errs = append(errs, err)
			continue
		}
		c.mod, c.fnVec, c.fnB1 = mod, fv, fb
		return nil
	}
	return fmt.Errorf("cuda: load %s: %w", src, errors.Join(errs...))
}

// Mode is the mode in use.
func (c *Copier) Mode() Mode { return c.mode }

// Device is the GPU ordinal of the engine's tensors.
func (c *Copier) Device() int { return c.ordinal }

func (c *Copier) String() string {
	if c.mode == Staged {
		prio := ""
		if c.opts.StagedLowPriority {
			prio = ", low priority"
		}
		return fmt.Sprintf("cuda:%d %s copies (vec16=%v, grid %d×%d%s, %d×%d-block staging slots, %d DMA streams)%s", c.ordinal, c.mode, c.vecOK, c.stagedGrid, c.opts.StagedThreads, prio, c.depth, c.stagingSlots, c.opts.DMAStreams, c.batchNote)
	}
	if c.mode == Batch {
		return fmt.Sprintf("cuda:%d %s copies (%s on %d streams, no kernel)", c.ordinal, c.mode, c.batchCall(), c.opts.DMAStreams)
	}
	if c.mode == Split {
		share := fmt.Sprintf("%d%% of each batch", c.opts.SplitPercent)
		if c.opts.SplitPercent == 0 {
			share = fmt.Sprintf("no fixed share: %d-block pieces", max(1, c.opts.SplitChunkBytes/c.bpb))
			if n := c.sharedBlocks.Load(); n > 0 {
				share += fmt.Sprintf(", %d%% of the %d blocks so far", 100*c.sharedBatch.Load()/n, n)
			}
		}
		return fmt.Sprintf("cuda:%d %s copies (%s by %s on %d streams, the rest staged: vec16=%v, grid %d×%d, %d×%d-block staging slots, %d DMA streams)", c.ordinal, c.mode, share, c.batchCall(), c.opts.SplitStreams, c.vecOK, c.stagedGrid, c.opts.StagedThreads, c.depth, c.stagingSlots, c.opts.DMAStreams)
	}
	if c.mode == Direct {
		return fmt.Sprintf("cuda:%d %s copies (%d DMA streams)", c.ordinal, c.mode, c.opts.DMAStreams)
	}
	return fmt.Sprintf("cuda:%d %s copies (vec16=%v, grid %d)", c.ordinal, c.mode, c.vecOK, c.grid)
}

// batchCall names the batched copy and its granularity for String.
func (c *Copier) batchCall() string {
	if c.mode == Split && c.plainWhileBusy() {
		return "cuMemcpyAsync, one copy per block,"
	}
	if c.pitched != nil {
		return "cuMemcpy3DBatchAsync, one pitched copy per block"
	}
	return "cuMemcpyBatchAsync"
}

// SetEngineStream names the engine's CUDA stream (a CUstream / cudaStream_t
// handle, e.g. torch.cuda.current_stream().cuda_stream) that Fence orders
// after; 0 is the legacy default stream.
func (c *Copier) SetEngineStream(h uintptr) { c.engineStream.Store(h) }

// MaxBatch implements worker.G1Copier.
func (c *Copier) MaxBatch() int { return c.opts.MaxBatch }

// with runs fn with the copier's context current on a locked OS thread, and
// restores the thread's previous context: calls arrive on engine threads
// (through the C ABI) whose own context must survive.
func (c *Copier) with(fn func() error) error {
	if c.closed.Load() {
		return errors.New("cuda: copier is closed")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.PushCurrentCtx(c.ctx); err != nil {
		return fmt.Errorf("cuda: make the primary context current: %w", err)
	}
	defer func() { _, _ = cu.PopCurrentCtx() }()
	return fn()
}

// Fence implements worker.G1Copier: the work of both directions enqueued
// from now on starts after everything enqueued on the engine stream so far.
func (c *Copier) Fence() error {
	c.fenceMu.Lock()
	defer c.fenceMu.Unlock()
	return c.with(func() error {
		var streams []uintptr
		for _, l := range c.lanes {
			for i := range l.dma {
				streams = append(streams, rawStream(&l.dma[i]))
			}
			for i := range l.bdma {
				streams = append(streams, rawStream(&l.bdma[i]))
			}
			streams = append(streams, rawStream(&l.kstream))
		}
		if err := fence(rawEvent(&c.fenceEv), c.engineStream.Load(), streams...); err != nil {
			return fmt.Errorf("cuda: %w", err)
		}
		return nil
	})
}

// RegisterHost implements worker.G1Copier: page-locks r and maps it for
// the device.
func (c *Copier) RegisterHost(r *storage.HostRegion) error {
	base := uintptr(unsafe.Pointer(&r.IOBlock(0)[0]))
	size := r.Stride() * int64(r.NumBlocks())
	return c.with(func() error {
		dev, err := hostRegister(base, size)
		if err != nil {
			return fmt.Errorf("cuda: page-lock %d host blocks (%d bytes): %w", r.NumBlocks(), size, err)
		}
		c.regMu.Lock()
		c.regions = append(c.regions, region{host: base, dev: dev, size: size})
		c.regMu.Unlock()
		return nil
	})
}

// devAddr translates a host buffer of n bytes to its device alias.
func (c *Copier) devAddr(p uintptr, n int64) (uintptr, error) {
	c.regMu.RLock()
	defer c.regMu.RUnlock()
	for _, r := range c.regions {
		if p >= r.host && int64(p-r.host)+n <= r.size {
			return r.dev + (p - r.host), nil
		}
	}
	return 0, fmt.Errorf("cuda: host buffer %#x (%d bytes) is not in a registered host region", p, n)
}

// GatherBlocks implements worker.G1Copier (G1 → host).
func (c *Copier) GatherBlocks(blocks []int, dsts [][]byte) error {
	return c.run(c.lanes[0], false, blocks, dsts)
}

// ScatterBlocks implements worker.G1Copier (host → G1).
func (c *Copier) ScatterBlocks(blocks []int, srcs [][]byte) error {
	return c.run(c.lanes[1], true, blocks, srcs)
}

func (c *Copier) run(l *lane, toG1 bool, blocks []int, bufs [][]byte) error {
	if len(blocks) != len(bufs) {
		return fmt.Errorf("cuda: %d blocks but %d buffers", len(blocks), len(bufs))
	}
	if len(blocks) == 0 {
		return nil
	}
	host := make([]uintptr, len(bufs))
	for i, b := range blocks {
		if b < 0 || b >= c.eng.NumBlocks {
			return fmt.Errorf("cuda: G1 block %d out of range [0, %d)", b, c.eng.NumBlocks)
		}
		if int64(len(bufs[i])) < c.bpb {
			return fmt.Errorf("cuda: buffer %d holds %d bytes, a block is %d", i, len(bufs[i]), c.bpb)
		}
		host[i] = uintptr(unsafe.Pointer(&bufs[i][0]))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return c.with(func() error {
		var err error
		switch c.mode {
		case Direct:
			err = c.runDirect(l, toG1, blocks, host)
		case Staged:
			err = c.runStaged(l, toG1, blocks, host)
		case Batch:
			err = c.runBatch(l.dma, toG1, blocks, host)
		case Split:
			err = c.runSplit(l, toG1, blocks, host)
		default:
			err = c.runKernel(l, toG1, blocks, host)
		}
		// Wait even after an enqueue error: work already queued may still
		// touch the buffers the caller is about to reuse.
		if serr := l.synchronize(); serr != nil {
			err = errors.Join(err, fmt.Errorf("cuda: synchronize: %w", serr))
		}
		return err
	})
}

// descriptors makes the lane's descriptor buffers hold n entries and
// returns the page-locked host side: [G1 block ids n][copy addresses n].
func (l *lane) descriptors(n int) ([]uint64, error) {
	if n > l.descCap {
		if err := l.freeDesc(); err != nil {
			return nil, err
		}
		want := max(n, 1024)
		var err error
		if l.descH, err = hostAlloc(int64(16 * want)); err != nil {
			return nil, fmt.Errorf("cuda: descriptor buffer: %w", err)
		}
		if l.descD, err = cu.MemAlloc(int64(16 * want)); err != nil {
			_ = hostFree(l.descH)
			l.descH = 0
			return nil, fmt.Errorf("cuda: device descriptor buffer: %w", err)
		}
		l.descCap = want
	}
	return unsafe.Slice((*uint64)(unsafePtr(l.descH)), 2*n), nil
}

// upload writes the batch's descriptors (G1 block ids, then copy addresses)
// to the lane's device buffer with one copy and returns where each array starts.
func (c *Copier) upload(l *lane, s cu.Stream, blocks []int, addrs []uintptr) (ids, dAddrs cu.DevicePtr, err error) {
	n := len(blocks)
	d, err := l.descriptors(n)
	if err != nil {
		return 0, 0, err
	}
	for i, b := range blocks {
		d[i] = uint64(b)
		d[n+i] = uint64(addrs[i])
	}
	if err := cu.MemcpyHtoDAsync(l.descD, unsafePtr(l.descH), int64(16*n), s); err != nil {
		return 0, 0, fmt.Errorf("cuda: upload descriptors: %w", err)
	}
	return l.descD, l.descD + cu.DevicePtr(8*n), nil
}

// launch runs the copy kernel over n batch entries on s with at most maxGrid
// thread blocks. addrs are the entries' host-side (or staging) addresses,
// checked for 16-byte alignment.
func (c *Copier) launch(s cu.Stream, maxGrid, threads int, toG1 bool, ids, dAddrs cu.DevicePtr, n int, addrs []uintptr) error {
	fn := c.fnVec
	if !c.vecOK || c.bpb%16 != 0 {
		fn = c.fnB1
	} else {
		for _, a := range addrs {
			if a%16 != 0 {
				fn = c.fnB1
				break
			}
		}
	}
	chunks := int64(n) * int64(c.eng.NumLayers) * int64(c.eng.OuterDim)
	grid := int(min(chunks, int64(maxGrid)))
	dir := int64(0)
	if toG1 {
		dir = 1
	}
	args := [10]uint64{
		uint64(c.bases), uint64(c.blockStride), uint64(c.outerStride), uint64(ids), uint64(dAddrs),
		uint64(n), uint64(c.eng.NumLayers), uint64(c.eng.OuterDim), uint64(c.eng.ChunkBytes), uint64(dir),
	}
	params := make([]unsafe.Pointer, len(args))
	for i := range args {
		params[i] = unsafe.Pointer(&args[i])
	}
	if err := fn.Launch(grid, 1, 1, threads, 1, 1, 0, s, params); err != nil {
		return fmt.Errorf("cuda: launch copy kernel (%d blocks): %w", n, err)
	}
	return nil
}

// synchronize waits for every stream of the lane.
func (l *lane) synchronize() error {
	var errs []error
	for i := range l.dma {
		errs = append(errs, l.dma[i].Synchronize())
	}
	for i := range l.bdma {
		errs = append(errs, l.bdma[i].Synchronize())
	}
	if l.kstream != (cu.Stream{}) {
		errs = append(errs, l.kstream.Synchronize())
	}
	return errors.Join(errs...)
}

func (l *lane) freeDesc() error {
	var errs []error
	if l.descD != 0 {
		errs = append(errs, cu.MemFree(l.descD))
		l.descD = 0
	}
	if l.descH != 0 {
		errs = append(errs, hostFree(l.descH))
		l.descH = 0
	}
	l.descCap = 0
	return errors.Join(errs...)
}

// release frees what New and the copies allocated; the context must be current.
func (c *Copier) release() error {
	var errs []error
	for _, l := range c.lanes {
		if l == nil {
			continue
		}
		l.mu.Lock()
		errs = append(errs, l.synchronize())
		errs = append(errs, l.freeDesc())
		if l.staging != 0 {
			errs = append(errs, cu.MemFree(l.staging))
			l.staging = 0
		}
		for i := range l.dma {
			errs = append(errs, l.dma[i].Destroy())
		}
		for i := range l.bdma {
			errs = append(errs, l.bdma[i].Destroy())
		}
		l.dma, l.bdma, l.stream = nil, nil, cu.Stream{}
		if l.kstream != (cu.Stream{}) {
			errs = append(errs, l.kstream.Destroy())
		}
		for i := range l.kDone {
			errs = append(errs, cu.DestroyEvent(&l.kDone[i]))
		}
		for i := range l.dDone {
			errs = append(errs, cu.DestroyEvent(&l.dDone[i]))
		}
		l.kDone, l.dDone = nil, nil
		for _, evs := range l.bDone {
			for i := range evs {
				errs = append(errs, cu.DestroyEvent(&evs[i]))
			}
		}
		l.bDone = nil
		l.mu.Unlock()
	}
	c.regMu.Lock()
	for _, r := range c.regions {
		errs = append(errs, hostUnregister(r.host))
	}
	c.regions = nil
	c.regMu.Unlock()
	if c.bases != 0 {
		errs = append(errs, cu.MemFree(c.bases))
		c.bases = 0
	}
	if c.mod != (cu.Module{}) {
		errs = append(errs, c.mod.Unload())
	}
	// A Fence that passed the closed check before Close began holds fenceMu
	// until it is done with the event.
	c.fenceMu.Lock()
	if c.fenceEv != (cu.Event{}) {
		errs = append(errs, cu.DestroyEvent(&c.fenceEv))
	}
	c.fenceMu.Unlock()
	return errors.Join(errs...)
}

// Close implements worker.G1Copier: waits for queued copies, unregisters the
// host regions and frees the copier's device memory. The engine's tensors
// and the primary context (PyTorch's) stay.
func (c *Copier) Close() error {
	var err error
	cerr := c.with(func() error {
		c.closed.Store(true)
		err = c.release()
		return nil
	})
	if cerr != nil {
		return cerr
	}
	if err = errors.Join(err, c.dev.ReleasePrimaryCtx()); err != nil {
		return fmt.Errorf("cuda: close: %w", err)
	}
	return nil
}

func unsafePtr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }
