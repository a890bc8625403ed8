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
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/storage"
)

// Mode is how a Copier moves per-layer layouts.
type Mode uint8

const (
	// Auto: DefaultMode, for every layout.
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
)

// DefaultMode is what Auto picks. On an H200 (docs/cuda.md) the zero-copy
// kernel beat staging (by 5%) for every layout, and beat one DMA copy per
// block (by 2%) even for TensorRT-LLM's contiguous blocks.
const DefaultMode = Kernel

var modeNames = [...]string{Auto: "auto", Kernel: "kernel", Staged: "staged", Direct: "direct"}

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
	}
	return Auto, fmt.Errorf("DYN_KVBM_CUDA_COPY=%q: want auto, kernel, staged or direct", s)
}

// Options tune a Copier; zero values pick the defaults.
type Options struct {
	Mode Mode
	// StagingBytes is the device staging buffer per direction in Staged
	// mode (default 64 MiB, at least one block).
	StagingBytes int64
	// CTAsPerSM sizes the kernel grid (default 4 thread blocks per SM).
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

// lane is one direction's stream and scratch memory; its mutex serialises
// the calls of that direction.
type lane struct {
	mu      sync.Mutex
	stream  cu.Stream
	descCap int     // entries the descriptor buffers hold
	descH   uintptr // page-locked host descriptors: [ids n][addrs n] uint64
	descD   cu.DevicePtr
	staging cu.DevicePtr // Staged mode
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
	bases        cu.DevicePtr // NumLayers uint64: G1 address of chunk (0, l, 0)
	blockStride  int64
	outerStride  int64
	vecOK        bool // G1 addresses and chunk size are 16-byte multiples
	bpb          int64
	stagingSlots int

	fenceMu      sync.Mutex
	fenceEv      cu.Event
	engineStream atomic.Uintptr // the engine's CUDA stream (0: legacy default stream)

	regMu   sync.RWMutex
	regions []region

	lanes  [2]*lane // 0: G1 → host, 1: host → G1
	closed atomic.Bool
}

// New prepares a copier for e's tensors, which must all live on one GPU.
func New(e *layout.Engine, opts Options) (c *Copier, err error) {
	ord, err := DeviceOf(e.Base(0))
	if err != nil {
		return nil, err
	}
	if ord < 0 {
		return nil, fmt.Errorf("cuda copier: KV tensor 0 at %#x is not GPU memory", e.Base(0))
	}
	for i := 1; i < e.Tensors(); i++ {
		o, err := DeviceOf(e.Base(i))
		if err != nil {
			return nil, err
		}
		if o != ord {
			return nil, fmt.Errorf("cuda copier: KV tensor %d is on device %d, tensor 0 on device %d; one worker serves one GPU", i, o, ord)
		}
	}
	if opts.StagingBytes <= 0 {
		opts.StagingBytes = 64 << 20
	}
	if opts.CTAsPerSM <= 0 {
		opts.CTAsPerSM = 4
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 8192
	}
	dev, err := cu.GetDevice(ord)
	if err != nil {
		return nil, fmt.Errorf("cuda copier: device %d: %w", ord, err)
	}
	c = &Copier{eng: e, opts: opts, dev: dev, ordinal: ord, bpb: e.BytesPerBlock()}
	c.analyse()
	switch {
	case opts.Mode == Direct && !c.contiguousBlocks():
		return nil, fmt.Errorf("cuda copier: DYN_KVBM_CUDA_COPY=direct needs blocks contiguous in G1 (TensorRT-LLM layout); %v is not", e)
	case opts.Mode == Auto:
		c.mode = DefaultMode
	default:
		c.mode = opts.Mode
	}
	c.stagingSlots = int(max(1, opts.StagingBytes/c.bpb))

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if c.ctx, err = c.dev.RetainPrimaryCtx(); err != nil {
		return nil, fmt.Errorf("cuda copier: retain primary context of device %d: %w", ord, err)
	}
	if err := cu.PushCurrentCtx(c.ctx); err != nil {
		_ = c.dev.ReleasePrimaryCtx()
		return nil, fmt.Errorf("cuda copier: make device %d's primary context current: %w", ord, err)
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
	sms, err := c.dev.Attribute(cu.MultiprocessorCount)
	if err != nil {
		return nil, fmt.Errorf("cuda copier: multiprocessor count: %w", err)
	}
	c.grid = sms * opts.CTAsPerSM
	if c.fenceEv, err = cu.MakeEvent(cu.DisableTiming); err != nil {
		return nil, fmt.Errorf("cuda copier: create event: %w", err)
	}
	for i := range c.lanes {
		l := &lane{}
		if l.stream, err = cu.MakeStream(cu.NonBlocking); err != nil {
			return nil, fmt.Errorf("cuda copier: create stream: %w", err)
		}
		c.lanes[i] = l
	}
	bases := make([]uint64, e.NumLayers)
	for l := range bases {
		bases[l] = uint64(e.ChunkAddr(0, l, 0))
	}
	if c.bases, err = cu.MemAlloc(int64(8 * len(bases))); err != nil {
		return nil, fmt.Errorf("cuda copier: allocate %d layer addresses: %w", len(bases), err)
	}
	if err = cu.MemcpyHtoD(c.bases, unsafe.Pointer(&bases[0]), int64(8*len(bases))); err != nil {
		return nil, fmt.Errorf("cuda copier: upload layer addresses: %w", err)
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
	if c.opts.KernelsFile == "" {
		c.opts.KernelsFile = os.Getenv("KVBM_CUDA_KERNELS")
	}
	if c.opts.KernelsFile != "" {
		b, err := os.ReadFile(c.opts.KernelsFile)
		if err != nil {
			return fmt.Errorf("cuda copier: KVBM_CUDA_KERNELS: %w", err)
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
		return errors.New("cuda copier: this library was built without compiled kernels (run kernels/build.sh on a machine with nvcc, then go run kernels/gen.go)")
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
	return fmt.Errorf("cuda copier: load %s: %w", src, errors.Join(errs...))
}

// Mode is the mode in use.
func (c *Copier) Mode() Mode { return c.mode }

// Device is the GPU ordinal of the engine's tensors.
func (c *Copier) Device() int { return c.ordinal }

func (c *Copier) String() string {
	return fmt.Sprintf("cuda:%d %s copies (vec16=%v, grid %d)", c.ordinal, c.mode, c.vecOK, c.grid)
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
		return errors.New("cuda copier is closed")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.PushCurrentCtx(c.ctx); err != nil {
		return fmt.Errorf("cuda copier: make the primary context current: %w", err)
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
		return fence(rawEvent(&c.fenceEv), c.engineStream.Load(), rawStream(&c.lanes[0].stream), rawStream(&c.lanes[1].stream))
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
			return fmt.Errorf("cuda copier: page-lock %d host blocks (%d bytes): %w", r.NumBlocks(), size, err)
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
	return 0, fmt.Errorf("cuda copier: host buffer %#x (%d bytes) is not in a registered host region", p, n)
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
		return fmt.Errorf("cuda copier: %d blocks but %d buffers", len(blocks), len(bufs))
	}
	if len(blocks) == 0 {
		return nil
	}
	host := make([]uintptr, len(bufs))
	for i, b := range blocks {
		if b < 0 || b >= c.eng.NumBlocks {
			return fmt.Errorf("cuda copier: G1 block %d out of range [0, %d)", b, c.eng.NumBlocks)
		}
		if int64(len(bufs[i])) < c.bpb {
			return fmt.Errorf("cuda copier: buffer %d holds %d bytes, a block is %d", i, len(bufs[i]), c.bpb)
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
		default:
			err = c.runKernel(l, toG1, blocks, host)
		}
		// Wait even after an enqueue error: work already queued may still
		// touch the buffers the caller is about to reuse.
		if serr := l.stream.Synchronize(); serr != nil {
			err = errors.Join(err, fmt.Errorf("cuda copier: synchronize: %w", serr))
		}
		return err
	})
}

func (c *Copier) runDirect(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	for i, b := range blocks {
		g1 := cu.DevicePtr(c.eng.ChunkAddr(b, 0, 0))
		p := unsafePtr(host[i])
		var err error
		if toG1 {
			err = cu.MemcpyHtoDAsync(g1, p, c.bpb, l.stream)
		} else {
			err = cu.MemcpyDtoHAsync(p, g1, c.bpb, l.stream)
		}
		if err != nil {
			return fmt.Errorf("cuda copier: copy G1 block %d: %w", b, err)
		}
	}
	return nil
}

func (c *Copier) runKernel(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	addrs := make([]uintptr, len(host))
	for i, p := range host {
		d, err := c.devAddr(p, c.bpb)
		if err != nil {
			return err
		}
		addrs[i] = d
	}
	ids, dAddrs, err := c.upload(l, blocks, addrs)
	if err != nil {
		return err
	}
	return c.launch(l, toG1, ids, dAddrs, len(blocks), addrs)
}

func (c *Copier) runStaged(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	if l.staging == 0 {
		p, err := cu.MemAlloc(int64(c.stagingSlots) * c.bpb)
		if err != nil {
			return fmt.Errorf("cuda copier: allocate %d-block staging buffer: %w", c.stagingSlots, err)
		}
		l.staging = p
	}
	// Staging addresses of every batch entry (entry i uses slot i % slots);
	// the descriptors for all sub-batches go up in one copy.
	addrs := make([]uintptr, len(blocks))
	for i := range addrs {
		addrs[i] = uintptr(l.staging) + uintptr(int64(i%c.stagingSlots)*c.bpb)
	}
	ids, dAddrs, err := c.upload(l, blocks, addrs)
	if err != nil {
		return err
	}
	// One stream: each sub-batch's kernel and DMA copies run in order, so
	// the next sub-batch cannot overwrite staging still being copied.
	for lo := 0; lo < len(blocks); lo += c.stagingSlots {
		hi := min(lo+c.stagingSlots, len(blocks))
		off := cu.DevicePtr(8 * lo)
		if !toG1 {
			if err := c.launch(l, false, ids+off, dAddrs+off, hi-lo, addrs[lo:hi]); err != nil {
				return err
			}
		}
		for i := lo; i < hi; i++ {
			st := cu.DevicePtr(addrs[i])
			var err error
			if toG1 {
				err = cu.MemcpyHtoDAsync(st, unsafePtr(host[i]), c.bpb, l.stream)
			} else {
				err = cu.MemcpyDtoHAsync(unsafePtr(host[i]), st, c.bpb, l.stream)
			}
			if err != nil {
				return fmt.Errorf("cuda copier: staging copy of G1 block %d: %w", blocks[i], err)
			}
		}
		if toG1 {
			if err := c.launch(l, true, ids+off, dAddrs+off, hi-lo, addrs[lo:hi]); err != nil {
				return err
			}
		}
	}
	return nil
}

// upload writes the batch's descriptors (G1 block ids, then copy addresses)
// to the lane's device buffer with one copy and returns where each array starts.
func (c *Copier) upload(l *lane, blocks []int, addrs []uintptr) (ids, dAddrs cu.DevicePtr, err error) {
	n := len(blocks)
	if n > l.descCap {
		if err := l.freeDesc(); err != nil {
			return 0, 0, err
		}
		want := max(n, 1024)
		if l.descH, err = hostAlloc(int64(16 * want)); err != nil {
			return 0, 0, fmt.Errorf("cuda copier: descriptor buffer: %w", err)
		}
		if l.descD, err = cu.MemAlloc(int64(16 * want)); err != nil {
			_ = hostFree(l.descH)
			l.descH = 0
			return 0, 0, fmt.Errorf("cuda copier: device descriptor buffer: %w", err)
		}
		l.descCap = want
	}
	d := unsafe.Slice((*uint64)(unsafePtr(l.descH)), 2*n)
	for i, b := range blocks {
		d[i] = uint64(b)
		d[n+i] = uint64(addrs[i])
	}
	if err := cu.MemcpyHtoDAsync(l.descD, unsafePtr(l.descH), int64(16*n), l.stream); err != nil {
		return 0, 0, fmt.Errorf("cuda copier: upload descriptors: %w", err)
	}
	return l.descD, l.descD + cu.DevicePtr(8*n), nil
}

// launch runs the copy kernel over n batch entries. addrs are the entries'
// host-side (or staging) addresses, checked for 16-byte alignment.
func (c *Copier) launch(l *lane, toG1 bool, ids, dAddrs cu.DevicePtr, n int, addrs []uintptr) error {
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
	grid := int(min(chunks, int64(c.grid)))
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
	if err := fn.Launch(grid, 1, 1, 256, 1, 1, 0, l.stream, params); err != nil {
		return fmt.Errorf("cuda copier: launch copy kernel (%d blocks): %w", n, err)
	}
	return nil
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
		errs = append(errs, l.stream.Synchronize(), l.freeDesc())
		if l.staging != 0 {
			errs = append(errs, cu.MemFree(l.staging))
			l.staging = 0
		}
		errs = append(errs, l.stream.Destroy())
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
	if c.fenceEv != (cu.Event{}) {
		errs = append(errs, cu.DestroyEvent(&c.fenceEv))
	}
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
	return errors.Join(err, c.dev.ReleasePrimaryCtx())
}

func unsafePtr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }
