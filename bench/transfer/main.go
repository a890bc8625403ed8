// Command transfer measures kvbm's worker transfers against same-run
// baselines and prints a table:
//
//   - G2 offload (G1→G2) and onboard (G2→G1) of N scattered 16-token blocks in
//     the vLLM FlashAttention layout (32 layers, 8 KV heads, head_dim 128,
//     2-byte dtype) vs one contiguous memcpy of the same number of bytes;
//   - G3 write (G2→G3, checksummed) and read (G3→G1, verified and scattered)
//     vs a plain sequential write (+fsync) and cold read of a file of the same size.
//
// Each operation and its baseline alternate for -reps rounds; the table shows
// medians. Memory: about 6 × N × 2 MiB of RAM (12 GiB at N=2048) and
// 4 × N × 2 MiB of disk in -dir.
//
//	go run ./bench/transfer -blocks 2048 -dir /var/tmp
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"slices"
	"time"

	"github.com/kvbm/kvbm/goext/worker"
	"github.com/kvbm/kvbm/goext/worker/workerbench"
)

func main() {
	blocks := flag.Int("blocks", 2048, "blocks per operation (2 MiB each)")
	dir := flag.String("dir", os.TempDir(), "directory on a real disk (not tmpfs) for the G3 file and the baseline file")
	reps := flag.Int("reps", 5, "rounds; the table shows medians")
	noDisk := flag.Bool("no-disk", false, "skip the G3 rows")
	conc := flag.Int("concurrency", worker.DefaultMaxConcurrent, "DYN_KVBM_MAX_CONCURRENT_TRANSFERS")
	batch := flag.Int("batch", worker.DefaultBatchSize, "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE")
	flag.Parse()
	o := workerbench.Options{Blocks: *blocks, Disk: !*noDisk, DiskDir: *dir, MaxConcurrent: *conc, BatchSize: *batch}
	if err := run(o, *reps); err != nil {
		fmt.Fprintln(os.Stderr, "bench/transfer:", err)
		os.Exit(1)
	}
}

type timed func() (time.Duration, error)

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func run(o workerbench.Options, reps int) error {
	blocks, disk := o.Blocks, o.Disk
	f, err := workerbench.New(o)
	if err != nil {
		return err
	}
	defer f.Close()

	memcpy := func() (time.Duration, error) { return f.Memcpy(), nil }
	type row struct {
		name, baseName string
		op, base       timed
	}
	rows := []row{
		{"G2 offload  G1→G2", "memcpy, one contiguous copy", f.Offload, memcpy},
		{"G2 onboard  G2→G1", "memcpy, one contiguous copy", f.Onboard, memcpy},
	}
	if disk {
		rows = append(rows,
			row{"G3 write    G2→G3", "plain file write + fsync", f.DiskWrite, f.PlainWrite},
			row{"G3 read     G3→G1", "plain file read, cold cache", f.DiskRead, f.PlainRead})
	}
	// Warm up: G2 and G3 must hold the working set before onboard/read rows,
	// and the first touch of every page should not count.
	for _, r := range rows {
		if _, err := r.op(); err != nil {
			return fmt.Errorf("%s: %w", r.name, err)
		}
		if _, err := r.base(); err != nil {
			return fmt.Errorf("%s: %w", r.baseName, err)
		}
	}

	fmt.Printf("kvbm transfer benchmark: %d scattered blocks × %d B = %.2f GB per operation\n",
		blocks, f.Engine.BytesPerBlock(), float64(f.Bytes)/1e9)
	fmt.Printf("layout: %v\n", f.Engine)
	fmt.Printf("worker: max concurrent batches %d, batch size %d, O_DIRECT %v; GOMAXPROCS-visible CPUs %d; %d rounds, medians\n\n",
		o.MaxConcurrent, o.BatchSize, f.Worker.DiskDirect(), numCPU(), reps)
	fmt.Printf("%-20s %8s   %-30s %8s   %6s\n", "operation", "GB/s", "baseline (same run)", "GB/s", "ratio")
	for _, r := range rows {
		var ops, bases []time.Duration
		for i := 0; i < reps; i++ {
			d, err := r.op()
			if err != nil {
				return fmt.Errorf("%s: %w", r.name, err)
			}
			ops = append(ops, d)
			if d, err = r.base(); err != nil {
				return fmt.Errorf("%s: %w", r.baseName, err)
			}
			bases = append(bases, d)
		}
		og, bg := f.GBps(median(ops)), f.GBps(median(bases))
		fmt.Printf("%-20s %8.2f   %-30s %8.2f   %5.0f%%\n", r.name, og, r.baseName, bg, 100*og/bg)
	}
	return nil
}

func numCPU() int { return runtime.GOMAXPROCS(0) }
