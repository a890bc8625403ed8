// Command g3persist measures what DYN_KVBM_DISK_PERSIST costs and what its
// recovery takes, with the non-persistent disk tier as the baseline in the
// same run:
//
//   - G3 write (G1→G3 saves, checksummed) and read (G3→G1 loads, verified) of
//     N blocks in a vLLM-like layout (32 layers, 8 KV heads, head_dim 128,
//     16 tokens, 2-byte dtype: 2 MiB per block), persistence off and on,
//     alternating for -reps rounds; the table shows medians. With
//     persistence on a write also computes the payload's MAC (integrity.Key.Seal),
//     invalidates the old header and writes the new one (two 4 KiB writes
//     per block); reads of blocks this process wrote check the XXH3 only, as
//     without persistence.
//
//   - Read of recovered blocks (G3→G1 right after a restart): the first load
//     of a recovered block also checks its payload's MAC; the tier is
//     reopened before each round.
//
//   - Recovery at start: the tier written above is closed, dropped from the
//     page cache and reopened: the time the worker's header scan took, per
//     block; and the leader's index rebuild (RestoreDisk) for those blocks.
//
//   - Recovery at the block count of a 100 GB tier of 2 MiB blocks (51,200
//     blocks by default, -scan-blocks): headers are what recovery reads, so
//     this tier's payloads are small (-scan-kib) to fit the disk of a test
//     machine; the per-block cost is what a 100 GB tier pays per block.
//
//     go run ./bench/g3persist                      # 256 blocks: 0.5 GB per operation
//     go run ./bench/g3persist -blocks 1024 -reps 5
package main

import (
	"cmp"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"
	"unsafe"

	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/node"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/worker"
)

var benchSecret = []byte("bench/g3persist storage secret")

// benchKey keys the persistent tiers' MACs (an override secret: the bench
// leaves no secret file behind). The MACs cost the same under any key.
var benchKey = func() integrity.Key {
	k, err := integrity.LocalKey(benchSecret, "")
	if err != nil {
		panic(err)
	}
	return k
}()

const (
	layers = 32
	heads  = 8
	bs     = 16
	hdim   = 128
)

func main() {
	blocks := flag.Int("blocks", 256, "blocks per operation (2 MiB each)")
	reps := flag.Int("reps", 3, "rounds; the table shows medians")
	dir := flag.String("dir", "", "directory for the tier files (default: a new one under /var/tmp)")
	scanBlocks := flag.Int("scan-blocks", 51200, "blocks of the large recovery measurement (0: skip it)")
	scanKiB := flag.Int("scan-kib", 16, "payload KiB per block of the large recovery measurement")
	flag.Parse()
	if err := run(*blocks, max(*reps, 1), *dir, *scanBlocks, *scanKiB); err != nil {
		fmt.Fprintln(os.Stderr, "bench/g3persist:", err)
		os.Exit(1)
	}
}

func run(n, reps int, dir string, scanBlocks, scanKiB int) error {
	if dir == "" {
		d, err := os.MkdirTemp("/var/tmp", "kvbm-g3persist-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	spec, err := g1(n)
	if err != nil {
		return err
	}
	eng, err := layout.NewEngine(spec)
	if err != nil {
		return err
	}
	bpb := eng.BytesPerBlock()
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// Each worker through the front door (goext/node), as the C ABI builds
	// it; the registry is the bench's own.
	deps := node.Deps{Registry: node.NewRegistry(), Logger: quiet}
	open := func(persist bool, sub string) (*worker.Worker, error) {
		cfg := &config.Config{DiskCacheOverrideBlocks: n, DiskCacheDir: filepath.Join(dir, sub), DiskPersist: persist,
			StorageSecret: benchSecret}
		nw, err := node.NewWorker(cfg, node.WorkerSpec{Layout: spec, NumWorkers: 1, Model: "bench-model",
			DType: "torch.bfloat16"}, deps)
		if err != nil {
			return nil, err
		}
		return nw.W, nil
	}
	off, err := open(false, "off")
	if err != nil {
		return err
	}
	defer off.Close()
	on, err := open(true, "on")
	if err != nil {
		return err
	}
	fmt.Printf("g3persist: %d blocks of %d bytes per operation, %d rounds, dir %s, O_DIRECT off=%v on=%v, %d CPUs\n",
		n, bpb, reps, dir, off.DiskDirect(), on.DiskDirect(), runtimeCPUs())
	if !off.DiskDirect() || !on.DiskDirect() {
		fmt.Println("  (no O_DIRECT: reads may come from the page cache)")
	}

	rng := rand.New(rand.NewPCG(1, 2))
	saves := make([]plan.Copy, n)
	loads := make([]plan.Copy, n)
	tags := make([]plan.BlockTag, n)
	for i := range n {
		saves[i] = plan.Copy{Src: plan.G1, SrcBlock: int64(i), Dst: plan.G3, DstBlock: int64(i)}
		loads[i] = plan.Copy{Src: plan.G3, SrcBlock: int64(i), Dst: plan.G1, DstBlock: int64(i)}
		h := rng.Uint64()
		tags[i] = plan.BlockTag{Block: int64(i), SeqHash: h, Parent: h ^ 1, HasParent: i > 0, Tokens: make([]uint32, bs)}
	}
	seq := map[*worker.Worker]uint64{}
	write := func(w *worker.Worker, tagged bool) (time.Duration, error) {
		seq[w]++
		s := &plan.Step{Seq: seq[w], Saves: saves}
		if tagged {
			s.Tags = tags
		}
		t := time.Now()
		if err := w.Bind(s); err != nil {
			return 0, err
		}
		w.StartLoad()
		w.WaitForSave()
		return time.Since(t), nil
	}
	read := func(w *worker.Worker) (time.Duration, error) {
		seq[w]++
		t := time.Now()
		if err := w.Bind(&plan.Step{Seq: seq[w], Loads: []plan.Load{{ReqID: "r", Copies: loads}}}); err != nil {
			return 0, err
		}
		w.StartLoad()
		w.WaitLoads()
		d := time.Since(t)
		if _, failed := w.Finished(); len(failed) > 0 {
			return 0, fmt.Errorf("%d loads failed", len(failed))
		}
		w.WaitForSave()
		return d, nil
	}
	var wOff, wOn, rOff, rOn []time.Duration
	for range reps {
		for _, m := range []struct {
			into *[]time.Duration
			fn   func() (time.Duration, error)
		}{
			{&wOff, func() (time.Duration, error) { return write(off, false) }},
			{&wOn, func() (time.Duration, error) { return write(on, true) }},
			{&rOff, func() (time.Duration, error) { return read(off) }},
			{&rOn, func() (time.Duration, error) { return read(on) }},
		} {
			d, err := m.fn()
			if err != nil {
				return err
			}
			*m.into = append(*m.into, d)
		}
	}
	bytes := float64(n) * float64(bpb)
	gbps := func(d time.Duration) float64 { return bytes / d.Seconds() / 1e9 }
	med := func(ds []time.Duration) float64 { return gbps(median(ds)) }
	// The spread of each column (slowest–fastest round) says how much of
	// the ratio is noise.
	spread := func(ds []time.Duration) string {
		return fmt.Sprintf("%.2f–%.2f", gbps(slices.Max(ds)), gbps(slices.Min(ds)))
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "G3 operation\tpersist off GB/s\t(rounds)\tpersist on GB/s\t(rounds)\ton / off\t")
	fmt.Fprintf(tw, "write G1→G3\t%.2f\t%s\t%.2f\t%s\t%.2f\t\n", med(wOff), spread(wOff), med(wOn), spread(wOn), med(wOn)/med(wOff))
	fmt.Fprintf(tw, "read G3→G1\t%.2f\t%s\t%.2f\t%s\t%.2f\t\n", med(rOff), spread(rOff), med(rOn), spread(rOn), med(rOn)/med(rOff))
	_ = tw.Flush()

	// Recovery of the tier just written, from a cold page cache.
	path := on.DiskPath()
	if err := on.Close(); err != nil {
		return err
	}
	dropCache(path)
	t := time.Now()
	re, err := open(true, "on")
	if err != nil {
		return err
	}
	openTime := time.Since(t)
	rec := re.Recovered()
	if len(rec.Blocks) != n {
		_ = re.Close()
		return fmt.Errorf("recovered %d of %d blocks", len(rec.Blocks), n)
	}
	// The first load of a recovered block checks its payload's MAC as
	// well: each round reads from a freshly reopened tier.
	var rRec []time.Duration
	for k := range reps {
		if k > 0 {
			if re, err = open(true, "on"); err != nil {
				return err
			}
		}
		d, err := read(re)
		_ = re.Close()
		if err != nil {
			return fmt.Errorf("read of recovered blocks: %w", err)
		}
		rRec = append(rRec, d)
	}
	tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "G3 operation\t\t\tpersist on GB/s\t(rounds)\trecovered / own\t")
	fmt.Fprintf(tw, "read recovered G3→G1\t\t\t%.2f\t%s\t%.2f\t\n", med(rRec), spread(rRec), med(rRec)/med(rOn))
	_ = tw.Flush()
	rebuild, err := leaderRebuild(rec, bpb)
	if err != nil {
		return err
	}
	tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "recovery\tblocks\theader scan\tper block\topen total\tleader rebuild\t")
	fmt.Fprintf(tw, "%d B blocks\t%d\t%v\t%v\t%v\t%v\t\n", bpb, n, rec.Duration.Round(time.Microsecond),
		(rec.Duration / time.Duration(n)).Round(time.Nanosecond), openTime.Round(time.Microsecond), rebuild.Round(time.Microsecond))
	if scanBlocks > 0 {
		d, per, rb, err := largeScan(filepath.Join(dir, "scan"), scanBlocks, int64(scanKiB)*1024, quiet)
		if err != nil {
			return err
		}
		fmt.Fprintf(tw, "%d B blocks\t%d\t%v\t%v\t\t%v\t\n", scanKiB*1024, scanBlocks, d.Round(time.Microsecond),
			per.Round(time.Nanosecond), rb.Round(time.Microsecond))
	}
	_ = tw.Flush()
	return nil
}

// g1 allocates a CPU-layout engine cache of n blocks (outside the Go heap).
func g1(n int) (layout.Spec, error) {
	shape := []int64{2, int64(n), heads, bs, hdim}
	size := int64(2)
	for _, d := range shape {
		size *= d
	}
	var ts []layout.Tensor
	for range layers {
		m, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return layout.Spec{}, err
		}
		for i := 0; i < len(m); i += 512 { // not zeros
			m[i] = byte(i >> 9)
		}
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: shape})
	}
	return layout.Spec{Kind: layout.CPU, Tensors: ts, NumBlocks: n, BlockSize: bs, DtypeBytes: 2}, nil
}

// largeScan writes a tier of n small blocks, every one with a header, and
// measures its recovery from a cold page cache, and the leader's rebuild.
func largeScan(dir string, n int, blockBytes int64, log *slog.Logger) (scan, perBlock, rebuild time.Duration, err error) {
	fp := fingerprint.Inputs{Model: "bench-scan", BlockSize: bs, TPSize: 1}.Sum()
	o := storage.DiskOptions{Dir: dir, NumBlocks: n, BlockBytes: blockBytes, Persist: true, Fingerprint: fp, Key: benchKey,
		Logger: log}
	d, err := storage.NewDiskRegion(o)
	if err != nil {
		return 0, 0, 0, err
	}
	buf, err := unix.Mmap(-1, 0, int(d.Stride()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, 0, 0, err
	}
	defer func() { _ = unix.Munmap(buf) }()
	for i := range n {
		buf[0], buf[1], buf[2] = byte(i), byte(i>>8), byte(i>>16)
		h := &storage.BlockHeader{SeqHash: uint64(i) + 1, Parent: uint64(i), HasParent: i > 0, Tokens: make([]uint32, bs),
			PayloadSum: xxh3.Hash(buf[:blockBytes]), WrittenAt: int64(i)}
		if err := d.WriteBlockHeader(i, buf, h); err != nil {
			_ = d.Close()
			return 0, 0, 0, err
		}
	}
	path := d.Path()
	if err := d.Close(); err != nil {
		return 0, 0, 0, err
	}
	dropCache(path)
	d, err = storage.NewDiskRegion(o)
	if err != nil {
		return 0, 0, 0, err
	}
	rec := d.Recovery()
	_ = d.Close()
	_ = os.Remove(path)
	if len(rec.Blocks) != n {
		return 0, 0, 0, fmt.Errorf("large scan: recovered %d of %d blocks", len(rec.Blocks), n)
	}
	rebuild, err = leaderRebuild(rec, blockBytes)
	return rec.Duration, rec.Duration / time.Duration(n), rebuild, err
}

// leaderRebuild times a leader's RestoreDisk of rec's blocks.
func leaderRebuild(rec storage.Recovery, bpb int64) (time.Duration, error) {
	maxIdx := 0
	blocks := make([]leader.RecoveredBlock, len(rec.Blocks))
	for k, b := range rec.Blocks {
		maxIdx = max(maxIdx, b.Index)
		blocks[k] = leader.RecoveredBlock{BlockTag: plan.BlockTag{Block: int64(b.Index), SeqHash: b.SeqHash, Parent: b.Parent,
			HasParent: b.HasParent, Tokens: b.Tokens}, WrittenAt: b.WrittenAt}
	}
	l, err := leader.New(leader.Options{Config: &config.Config{DiskCacheOverrideBlocks: maxIdx + 1, DiskPersist: true,
		CacheStatsMaxRequests: 1000, CacheStatsLogInterval: time.Hour}, BlockSize: bs, BytesPerBlock: bpb, NumWorkers: 1,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		return 0, err
	}
	t := time.Now()
	st, err := l.RestoreDisk([][]leader.RecoveredBlock{blocks})
	d := time.Since(t)
	if err == nil && st.Registered != len(blocks) {
		err = fmt.Errorf("leader registered %d of %d blocks", st.Registered, len(blocks))
	}
	return d, err
}

// dropCache evicts path from the page cache (only that file's pages), so
// recovery reads the device.
func dropCache(path string) {
	if fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
		_ = unix.Fdatasync(fd)
		_ = unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED)
		_ = unix.Close(fd)
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.SortFunc(s, func(a, b time.Duration) int { return cmp.Compare(a, b) })
	return s[len(s)/2]
}

func runtimeCPUs() int {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) == nil {
		return set.Count()
	}
	return 0
}
