package worker_test

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvbm/kvbm/internal/workerbench"
)

// The benchmarks share one fixture (G1 of 2 × N blocks, G2 and G3 of N
// blocks, N = KVBM_BENCH_BLOCKS, default 2,048 = 4 GiB per operation; about
// 12 GiB of RAM and 8 GiB of disk under os.TempDir(), which must be a real
// disk for the G3 numbers to mean anything). Compare:
//
//	BenchmarkOffloadG2, BenchmarkOnboardG2  vs  BenchmarkMemcpyBaseline
//	BenchmarkDiskWrite, BenchmarkDiskRead   vs  BenchmarkPlainFileWrite, BenchmarkPlainFileRead
var fixture *workerbench.Fixture

func TestMain(m *testing.M) {
	code := m.Run()
	if fixture != nil {
		fixture.Close()
	}
	os.Exit(code)
}

func benchFixture(b *testing.B) *workerbench.Fixture {
	b.Helper()
	if fixture == nil {
		n := 2048
		if s := os.Getenv("KVBM_BENCH_BLOCKS"); s != "" {
			v, err := strconv.Atoi(s)
			if err != nil || v <= 0 {
				b.Fatalf("KVBM_BENCH_BLOCKS=%q: want a positive integer", s)
			}
			n = v
		}
		f, err := workerbench.New(workerbench.Options{Blocks: n, Disk: true})
		if err != nil {
			b.Fatal(err)
		}
		fixture = f
		// Every benchmark may assume G2 and G3 hold the working set.
		if _, err := f.Offload(); err != nil {
			b.Fatal(err)
		}
		if _, err := f.DiskWrite(); err != nil {
			b.Fatal(err)
		}
	}
	return fixture
}

func bench(b *testing.B, op func() (time.Duration, error)) {
	f := benchFixture(b)
	b.SetBytes(f.Bytes)
	b.ResetTimer()
	for b.Loop() {
		if _, err := op(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkOffloadG2(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.Offload() })
}
func BenchmarkOnboardG2(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.Onboard() })
}
func BenchmarkMemcpyBaseline(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.Memcpy(), nil })
}
func BenchmarkDiskWrite(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.DiskWrite() })
}
func BenchmarkDiskRead(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.DiskRead() })
}
func BenchmarkPlainFileWrite(b *testing.B) {
	bench(b, func() (time.Duration, error) { return fixture.PlainWrite() })
}
func BenchmarkPlainFileRead(b *testing.B) {
	f := benchFixture(b)
	if _, err := f.PlainWrite(); err != nil {
		b.Fatal(err)
	}
	bench(b, func() (time.Duration, error) { return fixture.PlainRead() })
}
