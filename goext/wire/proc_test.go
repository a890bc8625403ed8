package wire

// Coordinator and worker PROCESSES on localhost moving real bytes: the test
// binary re-executes itself as a worker (TestMain, KVBM_WIRE_TEST_ROLE).
// Each worker owns a G1 (mmap'd memory in a real engine layout) filled with
// rank-specific random bytes and a worker.Worker with its own G2; the leader
// plans with leader.Leader and ships the plans over the side channel.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/internal/testports"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/transfer"
	"github.com/kvbm/kvbm/goext/worker"
)

const (
	envRole  = "KVBM_WIRE_TEST_ROLE"
	envRank  = "KVBM_WIRE_TEST_RANK"
	envWorld = "KVBM_WIRE_TEST_WORLD"
	envPub   = "KVBM_WIRE_TEST_PUB"
	envAck   = "KVBM_WIRE_TEST_ACK"
	envKind  = "KVBM_WIRE_TEST_KIND"
	envDieOn = "KVBM_WIRE_TEST_DIE_ON" // SIGKILL itself in the middle of this operation (1-based)
	envDir   = "KVBM_WIRE_TEST_DIR"

	procBlocks = 32 // G1 blocks per rank
	procBS     = 4  // tokens per block
	procHeads  = 2
	procHdim   = 16
	procLayers = 3
)

func TestMain(m *testing.M) {
	switch os.Getenv(envRole) {
	case "worker":
		os.Exit(workerMain())
	case "bind":
		os.Exit(bindMain())
	}
	os.Exit(m.Run())
}

// procG1 allocates one rank's KV cache outside the Go heap, as engine memory
// is, in the given layout, and fills it with bytes only this rank has.
func procG1(kind layout.Kind, rank int) (*layout.Engine, error) {
	var shape []int64
	switch kind {
	case layout.FlashAttn:
		shape = []int64{2, procBlocks, procBS, procHeads, procHdim}
	case layout.CPUPaged:
		shape = []int64{procBlocks, procHeads, procBS, 2 * procHdim}
	default:
		return nil, fmt.Errorf("test G1: layout %v not set up", kind)
	}
	n := int64(2)
	for _, d := range shape {
		n *= d
	}
	rng := rand.New(rand.NewPCG(uint64(rank)+1, 0x6b76626d))
	var ts []layout.Tensor
	for range procLayers {
		mem, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return nil, err
		}
		for i := range mem {
			mem[i] = byte(rng.Uint32())
		}
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&mem[0])), Shape: shape})
	}
	return layout.NewEngine(layout.Spec{Kind: kind, Tensors: ts, NumBlocks: procBlocks, BlockSize: procBS, DtypeBytes: 2})
}

func envInt(name string) int {
	v, _ := strconv.Atoi(os.Getenv(name))
	return v
}

// workerMain is one worker process: register G1, connect, execute what the
// leader broadcasts and check every onboarded block byte for byte against
// what this rank saved.
func workerMain() int {
	rank, world := envInt(envRank), envInt(envWorld)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("proc", "worker")
	kind, err := layout.ParseKind(os.Getenv(envKind))
	if err != nil {
		log.Error("bad kind", "err", err)
		return 2
	}
	g1, err := procG1(kind, rank)
	if err != nil {
		log.Error("G1", "err", err)
		return 2
	}
	bpb := g1.BytesPerBlock()
	var (
		w        *worker.Worker
		saved    = map[int64][]byte{} // G2 block → the G1 bytes this rank saved into it
		ops      int
		verified int
	)
	gather := func(b int64) []byte {
		buf := make([]byte, bpb)
		transfer.Gather(g1, int(b), buf)
		return buf
	}
	dieOn := envInt(envDieOn)
	wc, err := Connect(MemberOptions{
		Rank: rank, WorldSize: world, NumDeviceBlocks: procBlocks, BytesPerBlock: bpb,
		Endpoint:  Endpoint{Host: "127.0.0.1", PubPort: envInt(envPub), AckPort: envInt(envAck)},
		Transport: TransportTCP, RetryInterval: 20 * time.Millisecond, Logger: log,
		Allocate: func(md LeaderMetadata) error {
			var err error
			w, err = worker.New(worker.Options{Rank: rank, HostBlocks: md.NumHostBlocks, DiskBlocks: md.NumDiskBlocks,
				DiskDir: os.Getenv(envDir), DisableODirect: true, Logger: log})
			if err != nil {
				return err
			}
			return w.RegisterG1(g1)
		},
		Execute: func(_ context.Context, b []byte) error {
			ops++
			st, err := plan.Decode(b)
			if err != nil {
				return err
			}
			for _, c := range st.Saves {
				saved[c.DstBlock] = gather(c.SrcBlock)
			}
			if err := w.Bind(st); err != nil {
				return err
			}
			w.StartLoad()
			if ops == dieOn {
				log.Info("dying mid-transfer", "op", ops, "rank", rank)
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			}
			w.WaitForSave()
			w.WaitLoads()
			_, failed := w.Finished()
			if len(failed) > 0 {
				return fmt.Errorf("rank %d: loads into G1 blocks %v failed", rank, failed)
			}
			n := 0
			for _, ld := range st.Loads {
				for _, c := range ld.Copies {
					want, ok := saved[c.SrcBlock]
					if c.Src != plan.G2 || c.Dst != plan.G1 || !ok {
						return fmt.Errorf("rank %d: unexpected load %v[%d]→%v[%d]", rank, c.Src, c.SrcBlock, c.Dst, c.DstBlock)
					}
					if !bytes.Equal(gather(c.DstBlock), want) {
						return fmt.Errorf("rank %d: G1 block %d differs from the bytes saved into G2 block %d", rank, c.DstBlock, c.SrcBlock)
					}
					n++
				}
			}
			if n > 0 {
				verified += n
				log.Info(fmt.Sprintf("rank %d verified %d onboarded blocks byte for byte", rank, verified))
			}
			return nil
		},
	})
	if err != nil {
		log.Error("connect", "err", err)
		return 2
	}
	select {
	case <-wc.Done():
	case <-time.After(60 * time.Second):
		log.Error("no leader shutdown within 60 s")
	}
	_ = wc.Close()
	if w != nil {
		_ = w.Close()
	}
	return 0
}

// bindMain is a second engine's leader on ports that may be taken; it prints
// Listen's error.
func bindMain() int {
	l, err := Listen(CoordinatorOptions{NumWorkers: 2, Transport: TransportTCP, Size: fixedSize,
		Endpoint: Endpoint{Host: "127.0.0.1", PubPort: envInt(envPub), AckPort: envInt(envAck)}})
	if err != nil {
		fmt.Fprintln(os.Stderr, "LISTEN ERROR:", err)
		return 3
	}
	_ = l.Close()
	return 0
}

// procs tracks the worker processes of one test.
type procs struct {
	t    *testing.T
	pub  int
	ack  int
	n    int
	kind layout.Kind
	dir  string

	mu   sync.Mutex
	out  map[int]*syncBuf
	cmds map[int]*exec.Cmd
}

func newProcs(t *testing.T, n int, kind layout.Kind, pub, ack int) *procs {
	p := &procs{t: t, n: n, kind: kind, pub: pub, ack: ack, dir: t.TempDir(), out: map[int]*syncBuf{}, cmds: map[int]*exec.Cmd{}}
	t.Cleanup(func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		for r, c := range p.cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
			if t.Failed() {
				t.Logf("worker rank %d output:\n%s", r, p.out[r].String())
			}
		}
	})
	return p
}

func (p *procs) start(rank int, extra ...string) {
	p.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		envRole+"=worker", envRank+"="+strconv.Itoa(rank), envWorld+"="+strconv.Itoa(p.n),
		envPub+"="+strconv.Itoa(p.pub), envAck+"="+strconv.Itoa(p.ack), envKind+"="+p.kind.String(), envDir+"="+p.dir)
	cmd.Env = append(cmd.Env, extra...)
	out := &syncBuf{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(p.t, cmd.Start())
	p.mu.Lock()
	p.out[rank], p.cmds[rank] = out, cmd
	p.mu.Unlock()
}

// expect waits for a line in a worker's output: the output arrives through
// a pipe, after the side-channel ack that follows it.
func (p *procs) expect(rank int, want string) {
	p.t.Helper()
	checkFor(p.t, 10*time.Second, func() bool { return strings.Contains(p.output(rank), want) },
		fmt.Sprintf("worker rank %d output contains %q", rank, want))
}

func (p *procs) output(rank int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out[rank].String()
}

// wait waits for the workers to exit after the leader closed.
func (p *procs) wait() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for r, c := range p.cmds {
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case err := <-done:
			require.NoError(p.t, err, "worker rank %d:\n%s", r, p.out[r].String())
		case <-time.After(10 * time.Second):
			p.t.Fatalf("worker rank %d did not exit after the leader closed", r)
		}
		delete(p.cmds, r)
	}
}

func procConfig() *config.Config {
	return &config.Config{CPUCacheOverrideBlocks: 24, CacheStatsMaxRequests: 1000, CacheStatsLogInterval: time.Hour}
}

func procLeader(t *testing.T, n int, ep Endpoint, mod func(*CoordinatorOptions)) (*Coordinator, *syncBuf) {
	logs := &syncBuf{}
	opts := CoordinatorOptions{NumWorkers: n, Endpoint: ep, Transport: TransportTCP, Size: ConfigSize(procConfig()),
		// A generous SuspectAfter: these machines run other packages' tests
		// at the same time; only the SIGSTOP test wants a short one.
		InitTimeout: 30 * time.Second, PingInterval: 200 * time.Millisecond, SuspectAfter: 30 * time.Second,
		RetryInterval: 20 * time.Millisecond,
		Logger:        testLogger(logs)}
	if mod != nil {
		mod(&opts)
	}
	l, err := Listen(opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = l.Close()
		if t.Failed() {
			t.Logf("leader log:\n%s", logs.String())
		}
	})
	return l, logs
}

func tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000 + i)
	}
	return out
}

const flowBlocks = 6

// offloadThenOnboard plans with a real leader: request "a" computes 6 blocks
// in G1 blocks 0..5 (saved to G2), then request "b" with the same prefix
// matches them and loads them into G1 blocks 20..25. Each rank checks its
// shard; the broadcast only succeeds if every rank found its bytes exact.
func offloadThenOnboard(t *testing.T, l *Coordinator, hs Handshake) (*leader.Leader, [][]byte) {
	ld, err := leader.New(leader.Options{Config: procConfig(), BlockSize: procBS, BytesPerBlock: hs.BytesPerBlock,
		NumWorkers: hs.NumWorkers, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.Equal(t, ld.NumHostBlocks(), hs.NumHostBlocks, "wire and leader size G2 alike")

	ctx := ctxTimeout(t, 20*time.Second)
	toks := tokens(flowBlocks * procBS)
	ids := make([]int64, flowBlocks)
	for i := range ids {
		ids[i] = int64(i)
	}
	save, err := ld.Step([]leader.RequestUpdate{{ReqID: "a", NewTokens: toks, NewBlockIDs: ids, NumScheduledTokens: len(toks)}})
	require.NoError(t, err)
	st, err := plan.Decode(save)
	require.NoError(t, err)
	require.Len(t, st.Saves, flowBlocks)
	require.NoError(t, l.Broadcast(ctx, save))
	ld.RequestFinished("a")

	toksB := append(tokens(flowBlocks*procBS), 7, 8, 9)
	got, async := ld.GetNumNewMatchedTokens("b", toksB, 0, 0)
	require.True(t, async)
	require.Equal(t, flowBlocks*procBS, got)
	g1B := make([]int64, flowBlocks+1)
	for i := range g1B {
		g1B[i] = int64(20 + i)
	}
	ld.UpdateStateAfterAlloc("b", g1B, got)
	load, err := ld.Step(nil)
	require.NoError(t, err)
	st, err = plan.Decode(load)
	require.NoError(t, err)
	require.Len(t, st.Loads, 1)
	require.Len(t, st.Loads[0].Copies, flowBlocks)
	return ld, [][]byte{save, load}
}

// TestProcessesByteExact: 2 and 4 worker processes, offload then onboard
// into other G1 blocks, byte-exact on every rank's own shard.
func TestProcessesByteExact(t *testing.T) {
	for _, tc := range []struct {
		n    int
		kind layout.Kind
	}{{2, layout.FlashAttn}, {4, layout.CPUPaged}} {
		t.Run(fmt.Sprintf("%d_workers_%v", tc.n, tc.kind), func(t *testing.T) {
			l, _ := procLeader(t, tc.n, Endpoint{Host: "127.0.0.1"}, nil)
			p := newProcs(t, tc.n, tc.kind, l.Endpoint().PubPort, l.Endpoint().AckPort)
			for r := range tc.n {
				p.start(r)
			}
			hs, err := l.Handshake(ctxTimeout(t, 30*time.Second))
			require.NoError(t, err)
			ld, plans := offloadThenOnboard(t, l, hs)
			require.NoError(t, l.Broadcast(ctxTimeout(t, 20*time.Second), plans[1]))
			ld.LoadsFinished([]string{"b"})
			for r := range tc.n {
				p.expect(r, fmt.Sprintf("rank %d verified %d onboarded blocks byte for byte", r, flowBlocks))
			}
			require.NoError(t, l.Close())
			p.wait()
		})
	}
}

// TestProcessesLateAnyOrder: workers start before and after the leader, in
// shuffled order, some well after it began waiting.
func TestProcessesLateAnyOrder(t *testing.T) {
	ports := testports.Free(t, 2)
	p := newProcs(t, 4, layout.FlashAttn, ports[0], ports[1])
	p.start(3)
	p.start(1)
	time.Sleep(300 * time.Millisecond) // they retry until the leader binds
	l, logs := procLeader(t, 4, Endpoint{Host: "127.0.0.1", PubPort: ports[0], AckPort: ports[1]}, nil)
	type result struct {
		hs  Handshake
		err error
	}
	res := make(chan result, 1)
	go func() {
		hs, err := l.Handshake(context.Background())
		res <- result{hs, err}
	}()
	time.Sleep(300 * time.Millisecond)
	p.start(2)
	time.Sleep(300 * time.Millisecond)
	p.start(0)
	r := <-res
	require.NoError(t, r.err)
	require.Equal(t, 4, r.hs.NumWorkers)
	require.Contains(t, logs.String(), "ZMQ handshake complete; workers allocation ready")
	_, plans := offloadThenOnboard(t, l, r.hs)
	require.NoError(t, l.Broadcast(ctxTimeout(t, 20*time.Second), plans[1]))
	for rank := range 4 {
		p.expect(rank, fmt.Sprintf("rank %d verified %d", rank, flowBlocks))
	}
	require.NoError(t, l.Close())
	p.wait()
}

// TestProcessKilledMidTransfer: rank 1 SIGKILLs itself while executing the
// onboarding operation. The leader sees its process gone (not merely
// silent: the liveness timeout is far longer than the test), the broadcast
// fails naming rank 1, later broadcasts fail at once; nothing hangs.
func TestProcessKilledMidTransfer(t *testing.T) {
	l, logs := procLeader(t, 2, Endpoint{Host: "127.0.0.1"}, func(o *CoordinatorOptions) {
		o.PingInterval = 100 * time.Millisecond
	})
	p := newProcs(t, 2, layout.FlashAttn, l.Endpoint().PubPort, l.Endpoint().AckPort)
	p.start(0)
	p.start(1, envDieOn+"=2")
	hs, err := l.Handshake(ctxTimeout(t, 30*time.Second))
	require.NoError(t, err)
	_, plans := offloadThenOnboard(t, l, hs)

	err = l.Broadcast(ctxTimeout(t, 25*time.Second), plans[1])
	var dead *DeadRanksError
	require.ErrorAs(t, err, &dead, "got %v", err)
	require.Equal(t, []int{1}, dead.Ranks)
	require.True(t, dead.During)
	p.expect(1, "dying mid-transfer")
	p.expect(0, "rank 0 verified 6") // the surviving rank completed its shard
	require.Contains(t, logs.String(), "kvbm worker rank is gone; marked dead")
	require.Contains(t, logs.String(), "rank=1")

	err = l.Broadcast(ctxTimeout(t, 20*time.Second), plans[1])
	require.ErrorIs(t, err, ErrRankDead)
	require.ErrorContains(t, err, "rank(s) [1] dead")
	require.Equal(t, []int{1}, l.DeadRanks())

	require.NoError(t, l.Close())
	p.mu.Lock()
	c := p.cmds[1]
	delete(p.cmds, 1)
	p.mu.Unlock()
	var ee *exec.ExitError
	require.True(t, errors.As(c.Wait(), &ee), "rank 1 was killed")
	p.wait()
}

// TestProcessStoppedThenResumed: a worker process that hangs (SIGSTOP) is
// suspected, nothing is sent while it is, and once it resumes (SIGCONT
// after 3 s) it is re-admitted and its loads are byte-exact. The timeout is
// short, so only what holds on a slow machine is asserted: broadcasts are
// retried while any rank is suspected.
func TestProcessStoppedThenResumed(t *testing.T) {
	l, logs := procLeader(t, 2, Endpoint{Host: "127.0.0.1"}, func(o *CoordinatorOptions) {
		o.PingInterval = 100 * time.Millisecond
		o.SuspectAfter = time.Second
	})
	p := newProcs(t, 2, layout.CPUPaged, l.Endpoint().PubPort, l.Endpoint().AckPort)
	p.start(0)
	p.start(1)
	hs, err := l.Handshake(ctxTimeout(t, 30*time.Second))
	require.NoError(t, err)
	_, plans := offloadThenOnboard(t, l, hs)
	p.mu.Lock()
	pid := p.cmds[0].Process.Pid
	p.mu.Unlock()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	stopped := time.Now()
	defer func() { _ = syscall.Kill(pid, syscall.SIGCONT) }()
	checkFor(t, 20*time.Second, func() bool { return slices.Contains(l.SuspectRanks(), 0) }, "rank 0 suspected")
	err = l.Broadcast(ctxTimeout(t, 20*time.Second), plans[1])
	var sus *SuspectRanksError
	require.ErrorAs(t, err, &sus, "got %v", err)
	require.Contains(t, sus.Ranks, 0)
	require.Empty(t, l.DeadRanks(), "a stopped process is not dead")
	require.Contains(t, logs.String(), "kvbm worker rank not answering; suspected")

	time.Sleep(time.Until(stopped.Add(3 * time.Second))) // the scenario: stopped for 3 s
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	checkFor(t, 30*time.Second, func() bool { return len(l.SuspectRanks()) == 0 }, "rank 0 re-admitted")
	require.Contains(t, logs.String(), "kvbm worker rank answers again; re-admitted")

	// The onboarding runs on both ranks, each verifying its shard.
	deadline := time.Now().Add(60 * time.Second)
	for {
		err = l.Broadcast(ctxTimeout(t, 20*time.Second), plans[1])
		if !errors.Is(err, ErrRankSuspect) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	require.NoError(t, err)
	p.expect(0, "rank 0 verified 6")
	p.expect(1, "rank 1 verified 6")
	require.Empty(t, l.DeadRanks())
	require.NoError(t, l.Close())
	p.wait()
}

// TestProcessesHandshakeTimeout: rank 1 of 3 never starts; the error names it.
func TestProcessesHandshakeTimeout(t *testing.T) {
	l, _ := procLeader(t, 3, Endpoint{Host: "127.0.0.1"}, func(o *CoordinatorOptions) { o.InitTimeout = 2 * time.Second })
	p := newProcs(t, 3, layout.FlashAttn, l.Endpoint().PubPort, l.Endpoint().AckPort)
	p.start(0)
	p.start(2)
	_, err := l.Handshake(context.Background())
	require.ErrorIs(t, err, ErrHandshakeTimeout)
	require.ErrorContains(t, err, "rank(s) [1] of 3 never answered")
	require.ErrorContains(t, err, "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS=2s")
	require.NoError(t, l.Close())
	p.wait()
}

// TestProcessPortConflict: a second engine process on the first one's ports
// is told which variables to change.
func TestProcessPortConflict(t *testing.T) {
	l, _ := procLeader(t, 2, Endpoint{Host: "127.0.0.1"}, nil)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envRole+"=bind",
		envPub+"="+strconv.Itoa(l.Endpoint().PubPort), envAck+"="+strconv.Itoa(l.Endpoint().AckPort))
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, 3, ee.ExitCode(), string(out))
	msg := string(out)
	require.Contains(t, msg, fmt.Sprintf("DYN_KVBM_LEADER_ZMQ_PUB_PORT=%d", l.Endpoint().PubPort))
	require.Contains(t, msg, "give each engine its own DYN_KVBM_LEADER_ZMQ_PUB_PORT and DYN_KVBM_LEADER_ZMQ_ACK_PORT")
	require.True(t, strings.Contains(msg, "address already in use"), msg)
}
