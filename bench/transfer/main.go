// Command transfer measures kvbm's worker transfers against baselines of the
// same parallelism, measured in the same run, and prints one table per tier:
//
//   - G2 offload (G1→G2) and onboard (G2→G1) of N scattered 16-token blocks in
//     the vLLM FlashAttention layout (32 layers, 8 KV heads, head_dim 128,
//     2-byte dtype; 2 MiB per block). kvbm runs up to MaxConcurrent batches at
//     once with non-temporal stores; the baselines copy the same number of
//     bytes contiguously with MaxConcurrent goroutines, with copy() and with
//     non-temporal stores. The machine's copy ceiling (best STREAM-style copy
//     over thread counts) is printed for context.
//   - G3 write (G2→G3, checksummed) and read (G3→G1, verified and scattered).
//     kvbm keeps DiskDepth batches of O_DIRECT block I/Os in flight; the
//     baselines issue the same I/Os (size, queue depth, file region) with
//     nothing else to do, plus one buffered sequential reader from a cold
//     page cache. Neither side fsyncs. Ratios are refused when O_DIRECT is not
//     in effect (tmpfs and the like) or the tier file is in the page cache.
//
// Each operation and its baselines alternate for -reps rounds; the tables show
// medians. Memory: about 6 × N × 2 MiB of RAM and 2 × N × 2 MiB of disk.
//
//	go run ./bench/transfer                      # N = 256: 0.54 GB per operation, < 1 min
//	go run ./bench/transfer -blocks 2048 -reps 5 # the 4 GiB operations of the original figures
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvbm/kvbm/bench/internal/rows"
	"github.com/kvbm/kvbm/goext/transfer"
	"github.com/kvbm/kvbm/goext/worker"
	"github.com/kvbm/kvbm/internal/workerbench"
)

func main() {
	blocks := flag.Int("blocks", 256, "blocks per operation (2 MiB each)")
	dir := flag.String("dir", "", "directory on a real disk for the G3 tier and the baseline file; "+
		"default: the first of $TMPDIR, /var/tmp, . that is not tmpfs")
	reps := flag.Int("reps", 3, "rounds; the tables show medians")
	noDisk := flag.Bool("no-disk", false, "skip the G3 rows")
	conc := flag.Int("concurrency", worker.DefaultMaxConcurrent, "DYN_KVBM_MAX_CONCURRENT_TRANSFERS")
	batch := flag.Int("batch", worker.DefaultBatchSize, "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE")
	quick := flag.Bool("quick", false, "64 blocks, 2 rounds (a few seconds; CI)")
	flag.Parse()
	if *quick {
		*blocks, *reps = 64, 2
	}
	o := workerbench.Options{Blocks: *blocks, Disk: !*noDisk, DiskDir: *dir, MaxConcurrent: *conc, BatchSize: *batch}
	if err := run(o, max(*reps, 1)); err != nil {
		fmt.Fprintln(os.Stderr, "bench/transfer:", err)
		os.Exit(1)
	}
}

type timed func() (time.Duration, error)

// measure is one operation and its baselines, timed in alternation.
type measure struct {
	name  string
	op    timed
	bases []baseline
	// refuse, when set before the rounds or by check, replaces every ratio:
	// the comparison would not be honest (and says why).
	refuse string
	check  func() string // run before each round of op; a non-empty result refuses the ratios
}

type baseline struct {
	name string
	op   timed
}

type result struct {
	op    float64
	bases []float64
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func (m *measure) run(f *workerbench.Fixture, reps int) (result, error) {
	ops := make([]time.Duration, 0, reps)
	bases := make([][]time.Duration, len(m.bases))
	for range reps {
		if m.check != nil && m.refuse == "" {
			m.refuse = m.check()
		}
		d, err := m.op()
		if err != nil {
			return result{}, fmt.Errorf("%s: %w", m.name, err)
		}
		ops = append(ops, d)
		for i, b := range m.bases {
			d, err := b.op()
			if err != nil {
				return result{}, fmt.Errorf("%s, baseline %q: %w", m.name, b.name, err)
			}
			bases[i] = append(bases[i], d)
		}
	}
	r := result{op: f.GBps(median(ops))}
	for _, b := range bases {
		r.bases = append(r.bases, f.GBps(median(b)))
	}
	return r, nil
}

func run(o workerbench.Options, reps int) error {
	f, err := workerbench.New(o)
	if err != nil {
		return err
	}
	defer f.Close()
	o = f.Opts
	conc := o.MaxConcurrent

	// Warm up: G2 and G3 must hold the working set before the onboard and
	// read rows, the baseline file must be written once (as the tier file
	// is), and the first touch of every page should not count.
	warm := []timed{f.Offload, f.Onboard, func() (time.Duration, error) { return f.ParallelCopy(conc, false), nil }}
	if o.Disk {
		warm = append(warm, f.DiskWrite, f.DiskRead)
		if f.DirectErr() == nil {
			warm = append(warm, f.DirectWrite)
		}
	}
	for _, w := range warm {
		if _, err := w(); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
	}

	fmt.Printf("kvbm transfer benchmark (go run ./bench/transfer): %d scattered blocks × %d B = %.2f GB per operation; %d rounds, medians\n",
		o.Blocks, f.Engine.BytesPerBlock(), float64(f.Bytes)/1e9, reps)
	fmt.Printf("machine: %s, %d CPUs (GOMAXPROCS %d), %s/%s\n", cpuModel(), runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH)
	fmt.Printf("layout: %v\n", f.Engine)
	fmt.Printf("worker: up to %d memory batches and %d disk batches in flight, %d blocks per batch\n\n", conc, f.DiskDepth, o.BatchSize)

	if err := g2(f, reps); err != nil {
		return err
	}
	if o.Disk {
		return g3(f, reps)
	}
	return nil
}

func g2(f *workerbench.Fixture, reps int) error {
	conc := f.Opts.MaxConcurrent
	par := func(nt bool) timed {
		return func() (time.Duration, error) { return f.ParallelCopy(conc, nt), nil }
	}
	bases := []baseline{{goroutines(conc, "goroutine") + ", copy()", par(false)}}
	stores := "plain stores"
	if transfer.HaveNonTemporal {
		stores = "non-temporal stores"
		bases = append(bases, baseline{goroutines(conc, "goroutine") + ", non-temporal stores", par(true)})
	}
	ms := []*measure{
		{name: "G2 offload  G1→G2", op: f.Offload, bases: bases},
		{name: "G2 onboard  G2→G1", op: f.Onboard, bases: bases},
	}
	rs, err := measureAll(f, reps, ms)
	if err != nil {
		return err
	}
	// The ceiling is the best copy rate seen in this run: the STREAM-style
	// sweep, or an equal-parallelism baseline if one did better (it is one
	// of the sweep's configurations, measured at another moment).
	ceil := f.CopyCeiling(max(reps, 3))
	for _, r := range rs {
		for i, b := range r.bases {
			if b > ceil.GBps {
				ceil = workerbench.Ceiling{GBps: b, Threads: conc, NT: i == 1}
			}
		}
	}
	fmt.Printf("G2, host memory. kvbm: up to %d concurrent batches of %d scattered blocks, %s.\n", conc, f.Opts.BatchSize, stores)
	fmt.Printf("Baselines: the same number of bytes copied contiguously by %s (kvbm's concurrency), one share each.\n",
		goroutines(conc, "goroutine"))
	fmt.Printf("Ceiling: best STREAM-style copy (bytes copied/s) over %v threads, copy() and non-temporal stores: %.2f GB/s (%s, %s).\n",
		f.CeilingThreads(), ceil.GBps, goroutines(ceil.Threads, "thread"), map[bool]string{false: "copy()", true: "non-temporal stores"}[ceil.NT])
	return table(ms, rs, &ceil, "G2")
}

func g3(f *workerbench.Fixture, reps int) error {
	direct := f.Worker.DiskDirect()
	fmt.Printf("\nG3, disk: %s. O_DIRECT: kvbm %s, baselines %s.\n", f.FS, yesNo(direct), yesNoErr(f.DirectErr()))
	fmt.Printf("kvbm: up to %d batches of %d blocks in flight, one %d-byte I/O per block, checksummed (read: verified and scattered into G1).\n",
		f.DiskDepth, f.Opts.BatchSize, f.Engine.BytesPerBlock())
	fmt.Printf("Baselines: the same I/Os (size, %d in flight, file region) with O_DIRECT and nothing else to do; reads read kvbm's tier file.\n", f.DiskDepth)
	fmt.Printf("Durability: neither side fsyncs (kvbm's G3 write does not). Page cache: dropped and checked empty (mincore) before every kvbm read.\n")
	refuse := ""
	switch {
	case f.FS.Memory:
		refuse = fmt.Sprintf("%s is memory-backed (%s): no disk I/O; pass -dir on a real disk", f.FS.Dir, f.FS.Type)
	case !direct:
		refuse = fmt.Sprintf("kvbm fell back to buffered I/O on %s", f.FS.Type)
	case f.DirectErr() != nil:
		refuse = f.DirectErr().Error()
	}
	var wbase, rbase []baseline
	if f.DirectErr() == nil {
		wbase = append(wbase, baseline{"O_DIRECT, " + goroutines(f.DiskDepth, "writer") + ", no fsync", f.DirectWrite})
		rbase = append(rbase, baseline{"O_DIRECT, " + goroutines(f.DiskDepth, "reader") + ", same region", f.DirectRead})
	}
	rbase = append(rbase, baseline{"buffered, 1 sequential reader, cold", f.BufferedRead})
	cold := func() string {
		if err := f.DropTierCache(); err != nil {
			return err.Error()
		}
		n, err := f.TierResident()
		if err != nil {
			return err.Error()
		}
		if n > 0 {
			return fmt.Sprintf("%.1f MiB of the tier file in the page cache before kvbm's read", float64(n)/(1<<20))
		}
		return ""
	}
	ms := []*measure{
		{name: "G3 write    G2→G3", op: f.DiskWrite, bases: wbase, refuse: refuse},
		{name: "G3 read     G3→G1", op: f.DiskRead, bases: rbase, refuse: refuse, check: cold},
	}
	rs, err := measureAll(f, reps, ms)
	if err != nil {
		return err
	}
	rows.EmitMachine(rows.Machine{"bench_dir_fs": f.FS.String(), "o_direct": direct && f.DirectErr() == nil,
		"o_direct_note": refuse})
	return table(ms, rs, nil, "G3")
}

func measureAll(f *workerbench.Fixture, reps int, ms []*measure) ([]result, error) {
	var rs []result
	for _, m := range ms {
		r, err := m.run(f, reps)
		if err != nil {
			return nil, err
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// table runs ms and prints them: kvbm's GB/s, each baseline's, kvbm's ratio
// to each, and a line with the ratio to the strongest baseline (and the ceiling).
func table(ms []*measure, rs []result, ceil *workerbench.Ceiling, tier string) error {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 3, ' ', 0)
	var notes []string
	fmt.Fprintln(w, "operation\tkvbm GB/s\tbaseline (same run)\tGB/s\tkvbm / baseline")
	for mi, m := range ms {
		r := rs[mi]
		ratio := func(b float64) string {
			if m.refuse != "" {
				return "n/a"
			}
			return fmt.Sprintf("%.0f%%", 100*r.op/b)
		}
		best := -1
		for i := range m.bases {
			if best < 0 || r.bases[i] > r.bases[best] {
				best = i
			}
		}
		for i, b := range m.bases {
			name, kv := "", ""
			if i == 0 {
				name, kv = m.name, fmt.Sprintf("%.2f", r.op)
			}
			mark := ""
			if i == best && len(m.bases) > 1 {
				mark = " (strongest)"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%.2f\t%s%s\n", name, kv, b.name, r.bases[i], ratio(r.bases[i]), mark)
		}
		if len(m.bases) == 0 {
			fmt.Fprintf(w, "%s\t%.2f\t(none)\t\t\n", m.name, r.op)
		}
		if ceil != nil {
			fmt.Fprintf(w, "\t\tmachine copy ceiling (context)\t%.2f\t%.0f%%\n", ceil.GBps, 100*r.op/ceil.GBps)
		}
		if m.refuse != "" {
			notes = append(notes, fmt.Sprintf("%s: no ratio: %s", strings.Join(strings.Fields(m.name), " "), m.refuse))
		}
		emitRow(m, r, best, ceil, tier)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, n := range notes {
		fmt.Println(n)
	}
	return nil
}

// goroutines is "1 goroutine" or "n goroutines".
func goroutines(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

func yesNoErr(err error) string {
	if err == nil {
		return "yes"
	}
	if errors.Is(err, workerbench.ErrNoDirect) {
		return "NO"
	}
	return "error: " + err.Error()
}

// cpuModel is the first "model name" of /proc/cpuinfo, or GOARCH.
func cpuModel() string {
	fh, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return runtime.GOARCH
	}
	defer func() { _ = fh.Close() }()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return runtime.GOARCH
}

// emitRow is m's summary row: kvbm against the strongest baseline (the
// ceiling named too for G2); no ratio when m was refused.
func emitRow(m *measure, r result, best int, ceil *workerbench.Ceiling, tier string) {
	row := rows.Row{Bench: "transfer", Figure: strings.Join(strings.Fields(m.name), " ") + " (GB/s)",
		Kvbm: fmt.Sprintf("%.2f", r.op), Target: ">= 90% of the same-parallelism baseline"}
	if best < 0 {
		row.Baseline, row.Ratio = "(none)", "n/a"
		rows.Emit(row)
		return
	}
	row.Baseline = fmt.Sprintf("%s: %.2f", m.bases[best].name, r.bases[best])
	ratio := r.op / r.bases[best]
	row.Ratio = fmt.Sprintf("%.0f%%", 100*ratio)
	if ceil != nil {
		row.Baseline += fmt.Sprintf("; copy ceiling %.2f", ceil.GBps)
		row.Ratio += fmt.Sprintf(" (%.0f%% of ceiling)", 100*r.op/ceil.GBps)
	}
	if m.refuse != "" {
		row.Ratio = "n/a: " + m.refuse
	} else {
		row.OK = rows.Bool(ratio >= 0.9)
	}
	rows.Emit(row)
}
