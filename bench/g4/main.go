// Command g4 measures the G4 (object storage) tier against the same S3
// server's raw PUT/GET, in the same run: upload and download GB/s at the same
// object size and concurrency, and the scheduler-side latency a G4 lookup
// adds to a match (p50/p99).
//
//	go run ./bench/g4                          # starts versitygw on a temporary directory
//	go run ./bench/g4 -endpoint host:port -access-key K -secret-key S -bucket B
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/kvbm/kvbm/bench/internal/rows"
	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

func main() {
	endpoint := flag.String("endpoint", "", "S3 host:port (empty: start versitygw on a temporary directory)")
	ak := flag.String("access-key", s3test.AccessKey, "access key")
	sk := flag.String("secret-key", s3test.SecretKey, "secret key")
	bucket := flag.String("bucket", "kvbm-bench", "bucket")
	blocks := flag.Int("blocks", 384, "objects per measurement")
	rounds := flag.Int("rounds", 3, "alternating raw/kvbm rounds (the best of each is shown)")
	conc := flag.Int("concurrency", object.DefaultUploads, "requests in flight (kvbm's default uploads per rank)")
	sizesFlag := flag.String("sizes", "262144,2097152", "object payload sizes in bytes, comma separated")
	quick := flag.Bool("quick", false, "64 objects, 2 rounds (seconds; CI)")
	flag.Parse()
	if *quick {
		*blocks, *rounds = 64, 2
	}

	if *endpoint == "" {
		dir, err := os.MkdirTemp("", "kvbm-g4-bench-")
		if err != nil {
			log.Fatal(err)
		}
		defer os.RemoveAll(dir)
		srv, err := s3test.Launch(dir)
		if err != nil {
			log.Fatal(err)
		}
		defer srv.Stop()
		*endpoint = srv.Addr
		fmt.Printf("S3 server: versitygw on %s (posix backend in %s)\n", srv.Addr, dir)
	}
	var sizes []int
	for _, f := range bytes.Split([]byte(*sizesFlag), []byte(",")) {
		var n int
		if _, err := fmt.Sscan(string(f), &n); err != nil || n <= 0 {
			log.Fatalf("-sizes: %q", f)
		}
		sizes = append(sizes, n)
	}

	mc, err := minio.New(*endpoint, &minio.Options{Creds: credentials.NewStaticV4(*ak, *sk, ""), Region: "us-east-1"})
	if err != nil {
		log.Fatal(err)
	}
	cl, err := object.NewClient(object.ClientOptions{Host: *endpoint, Bucket: *bucket, Region: "us-east-1",
		AccessKey: *ak, SecretKey: *sk})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := cl.EnsureBucket(ctx, "us-east-1"); err != nil {
		log.Fatal(err)
	}

	fmt.Printf("\n%d objects per row, %d in flight, best of %d alternating rounds; raw = minio-go PutObject/GetObject "+
		"(same client options: single PUT, unsigned payload) of the same size on the same server\n\n", *blocks, *conc, *rounds)
	fmt.Printf("%-10s %-9s %12s %12s %8s\n", "object", "op", "raw GB/s", "kvbm GB/s", "kvbm/raw")
	for si, size := range sizes {
		payloads := make([][]byte, *blocks)
		for i := range payloads {
			payloads[i] = make([]byte, size)
			fill(payloads[i], uint64(si*1_000_000+i))
		}
		dsts := make([][]byte, *blocks)
		for i := range dsts {
			dsts[i] = make([]byte, size)
		}
		var rawPut, rawGet, kvUp, kvGet time.Duration
		best := func(cur *time.Duration, d time.Duration) {
			if *cur == 0 || d < *cur {
				*cur = d
			}
		}
		for round := range *rounds {
			prefix := fmt.Sprintf("raw-%d-%d-%d", size, round, time.Now().UnixNano())
			best(&rawPut, timeIt(len(payloads), *conc, func(i int) error {
				_, err := mc.PutObject(ctx, *bucket, fmt.Sprintf("%s/%016x", prefix, i), bytes.NewReader(payloads[i]),
					int64(size), minio.PutObjectOptions{DisableMultipart: true, DisableContentSha256: true,
						ContentType: "application/octet-stream"})
				return err
			}))
			best(&rawGet, timeIt(len(payloads), *conc, func(i int) error {
				o, err := mc.GetObject(ctx, *bucket, fmt.Sprintf("%s/%016x", prefix, i), minio.GetObjectOptions{})
				if err != nil {
					return err
				}
				defer o.Close()
				b := bytes.NewBuffer(dsts[i][:0])
				_, err = b.ReadFrom(o)
				return err
			}))

			fp := fingerprint.Inputs{Model: fmt.Sprintf("bench-%d-%d-%d", size, round, time.Now().UnixNano())}.Sum()
			// The store's default queue (bounded in blocks and bytes); the
			// producer waits for room as an engine would not (it would drop),
			// so that every block is uploaded and timed.
			st, err := object.NewStore(object.StoreOptions{Client: cl, Fingerprint: fp, BlockBytes: size,
				Uploads: *conc, Registry: object.NewRegistry(*blocks), Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				log.Fatal(err)
			}
			before := object.Snapshot()
			t0 := time.Now()
			for i, p := range payloads {
				for st.QueueLen() >= st.QueueCap() {
					time.Sleep(50 * time.Microsecond)
				}
				if !st.Enqueue(uint64(i+1), uint64(i), p) {
					log.Fatalf("upload %d dropped (queue of %d)", i, *blocks)
				}
			}
			if err := st.Flush(ctx); err != nil {
				log.Fatal(err)
			}
			best(&kvUp, time.Since(t0))
			if got := object.Snapshot().Uploaded - before.Uploaded; got != uint64(*blocks) {
				log.Fatalf("%d of %d uploads stored", got, *blocks)
			}
			best(&kvGet, timeIt(len(payloads), *conc, func(i int) error {
				return st.Download(ctx, uint64(i+1), dsts[i])
			}))
			for i := range dsts {
				if !bytes.Equal(dsts[i], payloads[i]) {
					log.Fatalf("download %d differs", i)
				}
			}
			st.Close()
		}
		total := float64(size) * float64(*blocks)
		row := func(op string, raw, kv time.Duration) {
			r, k := total/raw.Seconds()/1e9, total/kv.Seconds()/1e9
			fmt.Printf("%-10s %-9s %12.3f %12.3f %7.0f%%\n", human(size), op, r, k, 100*k/r)
			rows.Emit(rows.Row{Bench: "g4", Figure: fmt.Sprintf("%s %s, %d in flight (GB/s)", human(size), op, *conc),
				Kvbm: fmt.Sprintf("%.3f", k), Baseline: fmt.Sprintf("raw minio-go %s: %.3f", op, r),
				Ratio: fmt.Sprintf("%.0f%%", 100*k/r), Target: ">= 80% of raw", OK: rows.Bool(k >= 0.8*r)})
		}
		row("upload", rawPut, kvUp)
		row("download", rawGet, kvGet)
	}

	lookupLatency(cl, *blocks)
}

// lookupLatency: what a G4 lookup adds to the scheduler's match call
// (GetNumNewMatchedTokens), against the same leader without G4, and how long
// the background lookup itself takes.
func lookupLatency(cl *object.Client, nBlocks int) {
	const bs, reqs, promptBlocks = 16, 400, 64
	fp := fingerprint.Inputs{Model: fmt.Sprintf("bench-lookup-%d", time.Now().UnixNano())}.Sum()
	st, err := object.NewStore(object.StoreOptions{Client: cl, Fingerprint: fp, BlockBytes: 64,
		Registry: object.NewRegistry(100000), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer st.Close()
	// Half the prompts were stored by "another instance" (not in this
	// registry): a lookup has to ask the store.
	prompts := make([][]uint32, reqs)
	for i := range prompts {
		p := make([]uint32, promptBlocks*bs+1)
		fill32(p, uint64(i))
		prompts[i] = p
	}
	other, err := object.NewStore(object.StoreOptions{Client: cl, Fingerprint: fp, BlockBytes: 64,
		QueueBlocks: reqs / 2 * promptBlocks, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	for i := 0; i < reqs; i += 2 {
		for _, h := range hashing.SequenceHashes(prompts[i], bs, hashing.DefaultSaltHash, nil) {
			other.Enqueue(h, 0, make([]byte, 64))
		}
	}
	if err := other.Flush(context.Background()); err != nil {
		log.Fatal(err)
	}
	other.Close()

	mk := func(g4 *leader.G4Options) *leader.Leader {
		l, err := leader.New(leader.Options{Config: &config.Config{CPUCacheOverrideBlocks: 4096,
			CacheStatsMaxRequests: 1000, CacheStatsLogInterval: time.Hour}, BlockSize: bs, BytesPerBlock: 64,
			NumWorkers: 1, Logger: slog.New(slog.DiscardHandler), G4: g4})
		if err != nil {
			log.Fatal(err)
		}
		return l
	}
	measure := func(l *leader.Leader) (calls []time.Duration, wait []time.Duration) {
		for i, p := range prompts {
			id := fmt.Sprint("r", i)
			start := time.Now()
			for {
				t := time.Now()
				n, _ := l.GetNumNewMatchedTokens(id, p, 0, 0)
				calls = append(calls, time.Since(t))
				if n != leader.Pending {
					break
				}
				time.Sleep(200 * time.Microsecond) // the engine's next scheduler step
			}
			wait = append(wait, time.Since(start))
			l.RequestFinished(id)
		}
		return calls, wait
	}
	baseCalls, _ := measure(mk(nil))
	g4Calls, g4Wait := measure(mk(&leader.G4Options{Store: st, Async: true, WriteThrough: true}))
	fmt.Printf("\nmatch latency, %d requests of %d blocks (half stored by another instance), scheduler thread:\n", reqs, promptBlocks)
	fmt.Printf("%-34s %10s %10s\n", "", "p50", "p99")
	fmt.Printf("%-34s %10s %10s\n", "match call, no G4 (baseline)", pct(baseCalls, 50), pct(baseCalls, 99))
	fmt.Printf("%-34s %10s %10s\n", "match call, G4 (each call)", pct(g4Calls, 50), pct(g4Calls, 99))
	fmt.Printf("%-34s %10s %10s\n", "request: first ask → answer (G4)", pct(g4Wait, 50), pct(g4Wait, 99))
	rows.Emit(rows.Row{Bench: "g4", Figure: "match call p99 with G4 lookups (scheduler thread)",
		Kvbm: pct(g4Calls, 99), Baseline: "no G4: " + pct(baseCalls, 99), Ratio: "n/a", Target: "never waits on the network"})
	s := object.Snapshot()
	fmt.Printf("G4 lookups: %d blocks hit, %d missed; the scheduler thread never waits on the network (Pending)\n",
		s.LookupHits, s.LookupMisses)
	_ = nBlocks
}

func timeIt(n, conc int, f func(i int) error) time.Duration {
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Value
	t0 := time.Now()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := f(i); err != nil {
					firstErr.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		log.Fatal(err)
	}
	return time.Since(t0)
}

func pct(ds []time.Duration, p int) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)].Round(100 * time.Nanosecond).String()
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 7))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
}

func fill32(p []uint32, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 9))
	for i := range p {
		p[i] = r.Uint32N(50000)
	}
}

func human(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
