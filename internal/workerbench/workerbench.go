// Package workerbench is the shared fixture of the transfer benchmarks (the Go
// benchmarks in package worker and bench/transfer): a vLLM FlashAttention G1
// in host memory, a worker with G2 and G3 sized for the working set, and the
// baselines each number is compared with in the same run.
//
// Baselines have kvbm's parallelism, so a ratio says how close kvbm is to
// what the machine does with the same means: memcopy.go (G2: the same bytes
// copied by MaxConcurrent goroutines, and the machine's copy ceiling),
// diskio.go (G3: the same O_DIRECT I/Os at the same queue depth over the same
// file region, no fsync on either side), fs.go (which filesystem the bench
// directory is on; tmpfs is not a disk). Memcpy, PlainWrite and PlainRead are
// the older single-threaded baselines, kept for the Go benchmarks of package
// worker.
//
// Every method runs on the caller's goroutine and returns when its
// goroutines have ended; a Fixture is not safe for concurrent use.
package workerbench

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/worker"
)

// Shape of the benchmark: 16-token blocks of a 32-layer model with 8
// KV heads of dimension 128 in a 2-byte dtype (32 KiB per K or V chunk, 2 MiB
// per block).
const (
	Layers    = 32
	KVHeads   = 8
	HeadDim   = 128
	BlockSize = 16
	Dtype     = 2
)

// Options size a Fixture.
type Options struct {
	Blocks   int    // blocks moved per operation (the issue asks for 2,048)
	G1Blocks int    // engine blocks (≥ 2 × Blocks so sources and targets scatter); 0: 2 × Blocks
	Disk     bool   // also create a G3 tier and the baselines' file
	DiskDir  string // a directory on a real disk (not tmpfs); "": DefaultDir()
	// MaxConcurrent and BatchSize go to the worker; 0: its defaults (New
	// fills them in, the baselines use the same values).
	MaxConcurrent, BatchSize int
	Logger                   *slog.Logger
}

// Fixture holds the memory and worker of one benchmark run.
type Fixture struct {
	Opts   Options
	Engine *layout.Engine
	Worker *worker.Worker
	Bytes  int64 // bytes moved by one operation (Blocks × bytes per block)
	// DiskDepth is the number of G3 batches kvbm keeps in flight, and the
	// number of goroutines of the O_DIRECT baselines.
	DiskDepth int
	FS        FS // the filesystem of DiskDir (with Disk)

	g1      []byte // one mapping holding every layer's tensor back to back
	srcs    []int64
	dsts    []int64
	seq     uint64
	dir     string // temp dir for the disk tier and the baseline files
	plain   string // single-threaded baseline file (PlainWrite, PlainRead)
	scratch []byte // aligned buffer for the baseline file I/O

	// The O_DIRECT baselines (diskio.go).
	lanes     []byte // DiskDepth aligned buffers of one stride each
	writeFD   int    // DirectWrite's file, O_DIRECT
	readFD    int    // kvbm's tier file, O_DIRECT
	bufFD     int    // kvbm's tier file, buffered (BufferedRead, fadvise, mincore)
	directErr error  // why the O_DIRECT baselines cannot run (ErrNoDirect), or nil
}

// New maps G1, fills it, and starts a worker with G2 (and G3) of Blocks blocks.
func New(o Options) (*Fixture, error) {
	if o.Blocks <= 0 {
		return nil, errors.New("workerbench: Blocks must be > 0")
	}
	if o.G1Blocks == 0 {
		o.G1Blocks = 2 * o.Blocks
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if o.MaxConcurrent <= 0 {
		o.MaxConcurrent = worker.DefaultMaxConcurrent
	}
	if o.BatchSize <= 0 {
		o.BatchSize = worker.DefaultBatchSize
	}
	if o.DiskDir == "" {
		o.DiskDir = DefaultDir()
	}
	f := &Fixture{Opts: o, DiskDepth: DiskDepth(o.MaxConcurrent), writeFD: -1, readFD: -1, bufFD: -1}
	chunk := int64(BlockSize * KVHeads * HeadDim * Dtype)
	perLayer := 2 * int64(o.G1Blocks) * chunk
	var err error
	if f.g1, err = unix.Mmap(-1, 0, int(perLayer*Layers), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return nil, fmt.Errorf("workerbench: map G1 (%d bytes): %w", perLayer*Layers, err)
	}
	// Like a torch CPU tensor of this size: huge pages where the kernel gives them.
	_ = unix.Madvise(f.g1, unix.MADV_HUGEPAGE)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < len(f.g1); i += 4096 { // touch and vary every page cheaply
		f.g1[i] = byte(rng.Uint32())
	}
	tensors := make([]layout.Tensor, Layers)
	for l := range tensors {
		tensors[l] = layout.Tensor{
			Ptr:   uintptr(unsafe.Pointer(&f.g1[int64(l)*perLayer])),
			Shape: []int64{2, int64(o.G1Blocks), BlockSize, KVHeads, HeadDim},
		}
	}
	if f.Engine, err = layout.NewEngine(layout.Spec{Kind: layout.FlashAttn, Tensors: tensors,
		NumBlocks: o.G1Blocks, BlockSize: BlockSize, DtypeBytes: Dtype}); err != nil {
		f.Close()
		return nil, err
	}
	f.Bytes = int64(o.Blocks) * f.Engine.BytesPerBlock()
	perm := rng.Perm(o.G1Blocks)
	for i := 0; i < o.Blocks; i++ {
		f.srcs = append(f.srcs, int64(perm[i]))
		f.dsts = append(f.dsts, int64(perm[o.Blocks+i%(o.G1Blocks-o.Blocks)]))
	}
	wo := worker.Options{HostBlocks: o.Blocks, Logger: o.Logger, Metrics: metrics.New(),
		MaxConcurrent: o.MaxConcurrent, BatchSize: o.BatchSize}
	if o.Disk {
		if f.FS, err = StatFS(o.DiskDir); err != nil {
			f.Close()
			return nil, err
		}
		if f.dir, err = os.MkdirTemp(o.DiskDir, "kvbm-bench-"); err != nil {
			f.Close()
			return nil, fmt.Errorf("workerbench: temp dir: %w", err)
		}
		wo.DiskBlocks, wo.DiskDir = o.Blocks, f.dir
		f.plain = filepath.Join(f.dir, "plain")
		if f.scratch, err = unix.Mmap(-1, 0, int(f.Engine.BytesPerBlock()), unix.PROT_READ|unix.PROT_WRITE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE); err != nil {
			f.Close()
			return nil, err
		}
	}
	if f.Worker, err = worker.New(wo); err == nil {
		err = f.Worker.RegisterG1(f.Engine)
	}
	if err == nil && o.Disk {
		err = f.openDiskBaselines()
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Close releases everything.
func (f *Fixture) Close() {
	f.closeDiskBaselines()
	if f.Worker != nil {
		_ = f.Worker.Close()
	}
	for _, m := range [][]byte{f.g1, f.scratch, f.lanes} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
	if f.dir != "" {
		_ = os.RemoveAll(f.dir)
	}
}

func (f *Fixture) copies(src plan.Tier, srcs []int64, dst plan.Tier, dsts []int64) []plan.Copy {
	out := make([]plan.Copy, len(srcs))
	for i := range srcs {
		out[i] = plan.Copy{Src: src, SrcBlock: srcs[i], Dst: dst, DstBlock: dsts[i]}
	}
	return out
}

func (f *Fixture) seqIdx() []int64 {
	idx := make([]int64, f.Opts.Blocks)
	for i := range idx {
		idx[i] = int64(i)
	}
	return idx
}

func (f *Fixture) save(s *plan.Step) (time.Duration, error) {
	f.seq++
	s.Seq = f.seq
	start := time.Now()
	if err := f.Worker.Bind(s); err != nil {
		return 0, err
	}
	f.Worker.WaitForSave()
	return time.Since(start), nil
}

func (f *Fixture) load(s *plan.Step) (time.Duration, error) {
	f.seq++
	s.Seq = f.seq
	start := time.Now()
	if err := f.Worker.Bind(s); err != nil {
		return 0, err
	}
	f.Worker.StartLoad()
	f.Worker.WaitLoads()
	d := time.Since(start)
	if _, failed := f.Worker.Finished(); len(failed) > 0 {
		return d, fmt.Errorf("workerbench: %d blocks failed to load", len(failed))
	}
	return d, nil
}

// Offload copies Blocks scattered G1 blocks into G2 (the write-through save).
func (f *Fixture) Offload() (time.Duration, error) {
	return f.save(&plan.Step{Saves: f.copies(plan.G1, f.srcs, plan.G2, f.seqIdx())})
}

// Onboard copies the G2 blocks back into other scattered G1 blocks. Run Offload first.
func (f *Fixture) Onboard() (time.Duration, error) {
	return f.load(&plan.Step{Loads: []plan.Load{{ReqID: "bench", Copies: f.copies(plan.G2, f.seqIdx(), plan.G1, f.dsts)}}})
}

// Memcpy is the single-threaded baseline: one contiguous copy of Bytes bytes
// inside G1 memory. kvbm runs up to MaxConcurrent batches at once; compare it
// with ParallelCopy(MaxConcurrent, …) instead (bench/transfer does).
func (f *Fixture) Memcpy() time.Duration {
	n := f.Bytes
	if 2*n > int64(len(f.g1)) {
		n = int64(len(f.g1)) / 2
	}
	start := time.Now()
	copy(f.g1[n:2*n], f.g1[:n])
	d := time.Since(start)
	// Scale in case G1 was too small to hold two copies of the working set.
	return time.Duration(float64(d) * float64(f.Bytes) / float64(n))
}

// DiskWrite moves the G2 blocks to G3 (G2→G3, checksummed). Run Offload first.
func (f *Fixture) DiskWrite() (time.Duration, error) {
	return f.save(&plan.Step{Moves: f.copies(plan.G2, f.seqIdx(), plan.G3, f.seqIdx())})
}

// DiskRead onboards the G3 blocks into scattered G1 blocks (read, verify,
// scatter). Run DiskWrite first.
func (f *Fixture) DiskRead() (time.Duration, error) {
	return f.load(&plan.Step{Loads: []plan.Load{{ReqID: "bench", Copies: f.copies(plan.G3, f.seqIdx(), plan.G1, f.dsts)}}})
}

// PlainWrite is the old single-threaded disk baseline: write a fresh file of
// Bytes bytes sequentially (buffered, block-sized writes) and fsync it. kvbm's
// G3 write does not fsync; DirectWrite is its equal baseline.
func (f *Fixture) PlainWrite() (time.Duration, error) {
	_ = os.Remove(f.plain)
	start := time.Now()
	fh, err := os.OpenFile(f.plain, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return 0, err
	}
	for off := int64(0); off < f.Bytes; off += int64(len(f.scratch)) {
		if _, err := fh.Write(f.scratch); err != nil {
			_ = fh.Close()
			return 0, err
		}
	}
	if err := fh.Sync(); err != nil {
		_ = fh.Close()
		return 0, err
	}
	d := time.Since(start)
	// Leave the page cache cold for PlainRead, as kvbm's O_DIRECT reads are.
	_ = unix.Fadvise(int(fh.Fd()), 0, 0, unix.FADV_DONTNEED)
	return d, fh.Close()
}

// PlainRead reads PlainWrite's file sequentially from a cold page cache. Run
// PlainWrite first. DirectRead (same queue depth) is kvbm's equal baseline.
func (f *Fixture) PlainRead() (time.Duration, error) {
	fh, err := os.Open(f.plain)
	if err != nil {
		return 0, err
	}
	defer func() { _ = fh.Close() }()
	_ = unix.Fadvise(int(fh.Fd()), 0, 0, unix.FADV_DONTNEED)
	start := time.Now()
	var total int64
	for {
		n, err := fh.Read(f.scratch)
		total += int64(n)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return 0, err
		}
	}
	if total != f.Bytes {
		return 0, fmt.Errorf("workerbench: read %d bytes of %d", total, f.Bytes)
	}
	return time.Since(start), nil
}

// GBps converts a duration of one operation into decimal GB/s.
func (f *Fixture) GBps(d time.Duration) float64 {
	return float64(f.Bytes) / d.Seconds() / 1e9
}
