package worker

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/transfer"
)

// The kill -9 test: a child process (this test binary, re-executed) writes
// G3 blocks with tags as fast as it can; the parent kills it with SIGKILL
// at a random point, then opens the tier as the next engine would and
// checks that every recovered block loads and is byte-exact. Block
// contents are a function of their sequence hash, so the parent knows what
// each recovered block must hold.

const (
	killEnvDir   = "KVBM_TEST_PERSIST_WRITER_DIR"
	killEnvSeed  = "KVBM_TEST_PERSIST_WRITER_SEED"
	killEnvBuf   = "KVBM_TEST_PERSIST_WRITER_BUFFERED"
	killG1Blocks = 16
	killG3Blocks = 48
	killHdim     = 1024 // ~150 KB blocks: writes take long enough to be cut
)

// killG1 is a CPU-layout engine cache of killG1Blocks big blocks.
func killG1(t *testing.T) *layout.Engine {
	t.Helper()
	shape := []int64{2, killG1Blocks, 3, bs, killHdim}
	n := int64(2)
	for _, d := range shape {
		n *= d
	}
	var ts []layout.Tensor
	for range layers {
		m, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Munmap(m) })
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: shape})
	}
	e, err := layout.NewEngine(layout.Spec{Kind: layout.CPU, Tensors: ts, NumBlocks: killG1Blocks, BlockSize: bs, DtypeBytes: 2})
	require.NoError(t, err)
	return e
}

// contentOf is the payload a block with sequence hash h holds.
func contentOf(h uint64, n int64) []byte {
	r := rand.New(rand.NewPCG(h, h^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	return b
}

func killWorker(t *testing.T, e *layout.Engine, dir string, buffered bool, log io.Writer) *Worker {
	t.Helper()
	w, err := New(Options{DiskBlocks: killG3Blocks, DiskDir: dir, DiskPersist: true, MaxConcurrent: 4, BatchSize: 4,
		DisableODirect: buffered, DiskKey: testDiskKey,
		Fingerprint: fingerprint.FromEngine("kill-test", "torch.float16", e, 1, 0),
		Logger:      slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelWarn})), Metrics: metrics.New()})
	require.NoError(t, err)
	require.NoError(t, w.RegisterG1(e))
	return w
}

// TestPersistKillWriter is the child: it runs only when re-executed by
// TestPersistSurvivesKill.
func TestPersistKillWriter(t *testing.T) {
	dir := os.Getenv(killEnvDir)
	if dir == "" {
		t.Skip("child process of TestPersistSurvivesKill")
	}
	seed, _ := strconv.ParseUint(os.Getenv(killEnvSeed), 10, 64)
	rng := rand.New(rand.NewPCG(seed, 1))
	e := killG1(t)
	w := killWorker(t, e, dir, os.Getenv(killEnvBuf) != "", os.Stderr)
	bpb := e.BytesPerBlock()
	for step := uint64(1); ; step++ {
		s := &plan.Step{Seq: step}
		dsts := rng.Perm(killG3Blocks)[:killG1Blocks]
		for j, d := range dsts {
			h := rng.Uint64()
			transfer.Scatter(e, j, contentOf(h, bpb))
			s.Saves = append(s.Saves, plan.Copy{Src: plan.G1, SrcBlock: int64(j), Dst: plan.G3, DstBlock: int64(d)})
			s.Tags = append(s.Tags, plan.BlockTag{Block: int64(d), SeqHash: h, Parent: h + 1, HasParent: true})
		}
		if step%5 == 0 { // some drops too: their headers are invalidated
			s.Drops = []plan.Copy{{Src: plan.G3, SrcBlock: int64(rng.IntN(killG3Blocks))}}
		}
		b, err := s.Encode()
		require.NoError(t, err)
		require.NoError(t, w.BindStep(b))
		w.StartLoad()
		w.WaitForSave()
		fmt.Printf("step %d\n", step)
	}
}

// TestPersistSurvivesKill kills the writer at random points (at least 20
// times) and verifies the tier after each kill. Odd rounds write through
// the page cache (DYN_KVBM_DISK_DISABLE_O_DIRECT), where a killed write can
// stop part-way; even rounds use O_DIRECT where the filesystem has it.
func TestPersistSurvivesKill(t *testing.T) {
	if os.Getenv(killEnvDir) != "" {
		t.Skip("this is the child")
	}
	const kills = 20
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	deadline := time.Now().Add(3 * time.Minute)
	e := killG1(t)
	bpb := e.BytesPerBlock()
	totalRecovered := 0
	for k := range kills {
		require.True(t, time.Now().Before(deadline), "kill loop ran out of time after %d kills", k)
		cmd := exec.Command(os.Args[0], "-test.run=^TestPersistKillWriter$", "-test.v")
		buffered := k%2 == 1
		cmd.Env = append(os.Environ(), killEnvDir+"="+dir, fmt.Sprintf("%s=%d", killEnvSeed, rng.Uint64()))
		if buffered {
			cmd.Env = append(cmd.Env, killEnvBuf+"=1")
		}
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		cmd.Stderr = t.Output()
		require.NoError(t, cmd.Start())
		// Kill after a random number of completed steps, plus a random
		// delay that lands inside the next step's writes (or before them).
		target := 1 + rng.IntN(6)
		sc := bufio.NewScanner(out)
		seen := 0
		for seen < target && sc.Scan() {
			var n int
			if _, err := fmt.Sscanf(sc.Text(), "step %d", &n); err == nil {
				seen = n
			}
		}
		require.Equal(t, target, seen, "writer stopped before step %d", target)
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
		require.NoError(t, cmd.Process.Signal(unix.SIGKILL))
		go func() { _, _ = io.Copy(io.Discard, out) }() // drain so Wait returns
		_ = cmd.Wait()

		w := killWorker(t, e, dir, buffered, t.Output())
		rec := w.Recovered()
		// Headers are written in the background after a step: a kill right
		// after the first one may find none yet. Later rounds reopen the tier
		// with the earlier rounds' blocks.
		if k > 0 {
			require.NotZero(t, len(rec.Blocks), "kill %d: nothing recovered after %d full steps", k, target)
		}
		totalRecovered += len(rec.Blocks)
		// Load every recovered block, killG1Blocks at a time, and compare.
		for lo := 0; lo < len(rec.Blocks); lo += killG1Blocks {
			hi := min(lo+killG1Blocks, len(rec.Blocks))
			s := &plan.Step{Seq: uint64(lo + 1)}
			var ld plan.Load
			ld.ReqID = "verify"
			for j, b := range rec.Blocks[lo:hi] {
				ld.Copies = append(ld.Copies, plan.Copy{Src: plan.G3, SrcBlock: int64(b.Index), Dst: plan.G1, DstBlock: int64(j)})
			}
			s.Loads = []plan.Load{ld}
			_, failed := run(t, w, s)
			require.Empty(t, failed, "kill %d: recovered blocks failed verification on load", k)
			for j, b := range rec.Blocks[lo:hi] {
				got := make([]byte, bpb)
				transfer.Gather(e, j, got)
				require.Equal(t, contentOf(b.SeqHash, bpb), got, "kill %d: block %d not byte-exact", k, b.Index)
			}
		}
		t.Logf("kill %d (buffered %v) after step %d: %d blocks recovered, %d discarded %v, %d empty", k, buffered, target,
			len(rec.Blocks), rec.NumDiscarded(), rec.Discarded, rec.Empty)
		require.NoError(t, w.Close())
	}
	require.NotZero(t, totalRecovered)
	t.Logf("%d kills, %d blocks recovered and verified in all", kills, totalRecovered)
}
