package wire

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/internal/testports"
)

// fakeRank is a goroutine worker recording what it was asked to do.
type fakeRank struct {
	w *Member

	mu       sync.Mutex
	alloc    []LeaderMetadata
	executed [][]byte
	fail     string        // Execute returns this error when set
	block    chan struct{} // Execute waits on it when set
}

func (f *fakeRank) steps() [][]byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]byte(nil), f.executed...)
}

type cluster struct {
	ep     Endpoint
	tr     Transport
	ranks  []*fakeRank
	logs   *syncBuf
	secret string // given to the leader and every worker
}

func newCluster(t *testing.T, tr Transport, n int) *cluster {
	c := &cluster{tr: tr, logs: &syncBuf{}, secret: "engine-" + t.Name()}
	if tr == TransportTCP {
		p := testports.Free(t, 2)
		c.ep = Endpoint{Host: "127.0.0.1", PubPort: p[0], AckPort: p[1]}
	} else {
		// A distinct in-process endpoint per test.
		c.ep = Endpoint{Host: t.Name(), PubPort: 1, AckPort: 2}
	}
	c.ranks = make([]*fakeRank, n)
	for r := range c.ranks {
		c.ranks[r] = &fakeRank{}
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(c.logs.String())
		}
	})
	return c
}

func (c *cluster) connect(t *testing.T, rank int, mod func(*MemberOptions)) *Member {
	f := c.ranks[rank]
	opts := MemberOptions{
		Rank: rank, WorldSize: len(c.ranks), NumDeviceBlocks: 64, BytesPerBlock: 4096,
		Endpoint: c.ep, Transport: c.tr, RetryInterval: 20 * time.Millisecond, Logger: testLogger(c.logs),
		Secret: c.secret,
		Allocate: func(md LeaderMetadata) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.alloc = append(f.alloc, md)
			return nil
		},
		Execute: func(ctx context.Context, step []byte) error {
			f.mu.Lock()
			f.executed = append(f.executed, step)
			fail, block := f.fail, f.block
			f.mu.Unlock()
			if block != nil {
				select {
				case <-block:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			if fail != "" {
				return errors.New(fail)
			}
			return nil
		},
	}
	if mod != nil {
		mod(&opts)
	}
	w, err := Connect(opts)
	require.NoError(t, err)
	f.w = w
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	return w
}

func (c *cluster) listen(t *testing.T, mod func(*CoordinatorOptions)) *Coordinator {
	opts := CoordinatorOptions{
		NumWorkers: len(c.ranks), Endpoint: c.ep, Transport: c.tr, InitTimeout: 10 * time.Second,
		Size: fixedSize, PingInterval: 100 * time.Millisecond, SuspectAfter: 10 * time.Second,
		RetryInterval: 20 * time.Millisecond, Logger: testLogger(c.logs), Secret: c.secret,
	}
	if mod != nil {
		mod(&opts)
	}
	l, err := Listen(opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, l.Close()) })
	return l
}

var transports = []struct {
	name    string
	tr      Transport
	workers int
}{
	{"inproc_1", TransportInProc, 1},
	{"inproc_3", TransportInProc, 3},
	{"tcp_1", TransportTCP, 1},
	{"tcp_3", TransportTCP, 3},
}

// TestHandshakeAndBroadcast: workers that start before the leader, the
// handshake sizes and allocates every rank once, broadcasts run on every
// rank in order, and a rank's error comes back naming it.
func TestHandshakeAndBroadcast(t *testing.T) {
	for _, tc := range transports {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, tc.tr, tc.workers)
			// Half the ranks start before the leader binds, the rest after.
			for r := 0; r < tc.workers; r += 2 {
				c.connect(t, r, nil)
			}
			time.Sleep(50 * time.Millisecond)
			l := c.listen(t, nil)
			require.Equal(t, tc.tr, l.Transport())
			for r := 1; r < tc.workers; r += 2 {
				c.connect(t, r, nil)
			}
			require.ErrorIs(t, l.Broadcast(context.Background(), []byte("early")), ErrNotReady)

			hs, err := l.Handshake(ctxTimeout(t, 10*time.Second))
			require.NoError(t, err)
			require.Equal(t, Handshake{NumWorkers: tc.workers, BytesPerBlock: 4096, NumDeviceBlocks: 64, NumHostBlocks: 10, NumDiskBlocks: 20}, hs)
			for r, f := range c.ranks {
				md, err := f.w.WaitReady(ctxTimeout(t, 5*time.Second))
				require.NoError(t, err, "rank %d", r)
				require.Equal(t, LeaderMetadata{NumHostBlocks: 10, NumDiskBlocks: 20, WorldSize: tc.workers}, md)
				f.mu.Lock()
				require.Len(t, f.alloc, 1, "rank %d allocated more than once", r)
				f.mu.Unlock()
			}
			require.True(t, l.Healthy())
			again, err := l.Handshake(context.Background())
			require.NoError(t, err)
			require.Equal(t, hs, again, "a second Handshake returns the first result")

			for i := range 5 {
				require.NoError(t, l.Broadcast(ctxTimeout(t, 5*time.Second), []byte("op"+strconv.Itoa(i))))
			}
			for r, f := range c.ranks {
				require.Equal(t, [][]byte{[]byte("op0"), []byte("op1"), []byte("op2"), []byte("op3"), []byte("op4")}, f.steps(), "rank %d", r)
			}

			last := tc.workers - 1
			c.ranks[last].mu.Lock()
			c.ranks[last].fail = "disk full"
			c.ranks[last].mu.Unlock()
			err = l.Broadcast(ctxTimeout(t, 5*time.Second), []byte("bad"))
			require.ErrorContains(t, err, fmt.Sprintf("rank %d: disk full", last))
			require.NotErrorIs(t, err, ErrRankDead)
			require.True(t, l.Healthy(), "an operation error is not a dead rank")
		})
	}
}

func TestHandshakeTimeoutNamesMissingRanks(t *testing.T) {
	c := newCluster(t, TransportTCP, 4)
	c.connect(t, 0, nil)
	c.connect(t, 2, nil)
	l := c.listen(t, func(o *CoordinatorOptions) { o.InitTimeout = 700 * time.Millisecond })
	_, err := l.Handshake(context.Background())
	require.ErrorIs(t, err, ErrHandshakeTimeout)
	require.ErrorContains(t, err, "rank(s) [1 3] of 4 never answered")
	require.ErrorContains(t, err, config.EnvLeaderWorkerInitTimeoutSecs)
}

func TestHandshakeTimeoutNamesAllocatingRank(t *testing.T) {
	c := newCluster(t, TransportInProc, 2)
	release := make(chan struct{})
	defer close(release)
	c.connect(t, 0, nil)
	c.connect(t, 1, func(o *MemberOptions) {
		o.Allocate = func(LeaderMetadata) error { <-release; return nil }
	})
	l := c.listen(t, func(o *CoordinatorOptions) { o.InitTimeout = 500 * time.Millisecond })
	_, err := l.Handshake(context.Background())
	require.ErrorIs(t, err, ErrHandshakeTimeout)
	require.ErrorContains(t, err, "rank(s) [1] were still allocating")
	require.NotContains(t, err.Error(), "never answered")
}

func TestHandshakeRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(rank int, o *MemberOptions)
		want string
	}{
		{"bytes_per_block differ", func(r int, o *MemberOptions) {
			if r == 1 {
				o.BytesPerBlock = 2048
			}
		}, "rank 1 reports bytes_per_block 2048, rank 0 reports 4096"},
		{"device blocks differ", func(r int, o *MemberOptions) {
			if r == 1 {
				o.NumDeviceBlocks = 63
			}
		}, "rank 1 reports num_device_blocks 63, rank 0 reports 64"},
		{"world size differs", func(r int, o *MemberOptions) { o.WorldSize = 3 }, "rank 0 was started with world size 3, the leader expects 2"},
		{"allocation fails", func(r int, o *MemberOptions) {
			if r == 1 {
				o.Allocate = func(LeaderMetadata) error { return errors.New("mmap: cannot allocate memory") }
			}
		}, "wire: worker allocation failed: rank 1: rank 1: allocating 10 host and 20 disk blocks: mmap: cannot allocate memory"},
		{"rank outside the world", func(r int, o *MemberOptions) {
			if r == 1 {
				o.Rank, o.WorldSize = 2, 3
			}
		}, "a worker reported rank 2, but the leader expects 2 workers"},
		{"two processes claim a rank", func(r int, o *MemberOptions) { o.Rank = 0 }, "rank 0 is reported by two worker processes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, TransportTCP, 2)
			for r := range 2 {
				c.connect(t, r, func(o *MemberOptions) { tc.mod(r, o) })
			}
			l := c.listen(t, nil)
			_, err := l.Handshake(ctxTimeout(t, 10*time.Second))
			require.ErrorContains(t, err, tc.want)
			require.NotErrorIs(t, err, ErrHandshakeTimeout)
		})
	}
}

func TestHandshakeNoTier(t *testing.T) {
	c := newCluster(t, TransportInProc, 1)
	c.connect(t, 0, nil)
	l := c.listen(t, func(o *CoordinatorOptions) { o.Size = ConfigSize(&config.Config{}) })
	_, err := l.Handshake(ctxTimeout(t, 5*time.Second))
	require.ErrorIs(t, err, config.ErrNoTier)
}

func TestConfigSize(t *testing.T) {
	cfg := &config.Config{CPUCacheGB: 1, DiskCacheOverrideBlocks: 7}
	host, disk, err := ConfigSize(cfg)(1_000_000, 4)
	require.NoError(t, err)
	require.Equal(t, cfg.HostBlocks(4_000_000), host)
	require.Equal(t, 250, host) // 1e9 / (4 × 1e6)
	require.Equal(t, 7, disk)
}

// TestSilentRankMidOperation: a rank that stops answering while an
// operation runs is suspected by the heartbeat; the operation fails naming
// it, later broadcasts fail at once while it stays silent, nothing hangs.
// The timeout is short, so a loaded machine may suspect other ranks too:
// only what holds however slow the machine is gets asserted.
func TestSilentRankMidOperation(t *testing.T) {
	c := newCluster(t, TransportTCP, 3)
	for r := range 3 {
		c.connect(t, r, nil)
	}
	l := c.listen(t, func(o *CoordinatorOptions) {
		o.PingInterval = 50 * time.Millisecond
		o.SuspectAfter = 400 * time.Millisecond
	})
	_, err := l.Handshake(ctxTimeout(t, 10*time.Second))
	require.NoError(t, err)
	require.NoError(t, l.Broadcast(ctxTimeout(t, 5*time.Second), []byte("ok")))

	release := make(chan struct{})
	f := c.ranks[1]
	f.mu.Lock()
	f.block = release
	f.mu.Unlock()
	// Rank 1 is stuck in Execute; now its connection goes away. Its process
	// (this one) is alive, so the leader can only suspect it.
	go func() {
		checkFor(t, 5*time.Second, func() bool { return len(f.steps()) == 2 }, "rank 1 got the operation")
		f.w.mu.Lock()
		tr := f.w.t
		f.w.mu.Unlock()
		_ = tr.close()
	}()
	err = l.Broadcast(ctxTimeout(t, 30*time.Second), []byte("stuck"))
	close(release)
	var sus *SuspectRanksError
	require.ErrorAs(t, err, &sus)
	require.Contains(t, sus.Ranks, 1)
	require.True(t, sus.During)
	require.ErrorIs(t, err, ErrRankSuspect)
	require.NotErrorIs(t, err, ErrRankDead)
	require.Contains(t, l.SuspectRanks(), 1)
	require.Empty(t, l.DeadRanks(), "a live process is never dead")
	require.False(t, l.Healthy())
	require.Contains(t, c.logs.String(), "kvbm worker rank not answering; suspected")
	require.Contains(t, c.logs.String(), "rank=1")

	sent := len(c.ranks[0].steps())
	err = l.Broadcast(ctxTimeout(t, 5*time.Second), []byte("later"))
	require.ErrorAs(t, err, &sus)
	require.False(t, sus.During)
	require.Contains(t, sus.Ranks, 1)
	require.ErrorContains(t, err, "not answering heartbeats")
	require.Len(t, c.ranks[0].steps(), sent, "nothing is sent while a rank is suspected")
}

func TestBroadcastContextNamesPendingRanks(t *testing.T) {
	c := newCluster(t, TransportInProc, 2)
	c.connect(t, 0, nil)
	c.connect(t, 1, nil)
	release := make(chan struct{})
	defer close(release)
	c.ranks[0].block = release
	l := c.listen(t, nil)
	_, err := l.Handshake(ctxTimeout(t, 5*time.Second))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err = l.Broadcast(ctx, []byte("slow"))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "rank(s) [0] did not answer")
}

func TestPortInUse(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	free := testports.Free(t, 1)[0]

	for _, tc := range []struct {
		name   string
		ep     Endpoint
		envVar string
	}{
		{"pub", Endpoint{Host: "127.0.0.1", PubPort: port, AckPort: free}, config.EnvLeaderZMQPubPort},
		{"ack", Endpoint{Host: "127.0.0.1", PubPort: free, AckPort: port}, config.EnvLeaderZMQAckPort},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Listen(CoordinatorOptions{NumWorkers: 2, Endpoint: tc.ep, Transport: TransportTCP, Size: fixedSize})
			require.ErrorIs(t, err, ErrPortInUse)
			require.ErrorContains(t, err, fmt.Sprintf("%s=%d", tc.envVar, port))
			require.ErrorContains(t, err, "second engine on this host")
		})
	}
	// The failed attempt must not keep the free port.
	l, err := Listen(CoordinatorOptions{NumWorkers: 2, Endpoint: Endpoint{Host: "127.0.0.1", PubPort: free}, Transport: TransportTCP, Size: fixedSize})
	require.NoError(t, err)
	require.NoError(t, l.Close())
}

// TestTwoEnginesDefaultPorts: a second leader on the same ports (two engines
// with default settings) fails with the variable to change.
func TestTwoEnginesDefaultPorts(t *testing.T) {
	p := testports.Free(t, 2)
	ep := Endpoint{Host: "127.0.0.1", PubPort: p[0], AckPort: p[1]}
	first, err := Listen(CoordinatorOptions{NumWorkers: 2, Endpoint: ep, Transport: TransportTCP, Size: fixedSize})
	require.NoError(t, err)
	defer first.Close()
	_, err = Listen(CoordinatorOptions{NumWorkers: 2, Endpoint: ep, Transport: TransportTCP, Size: fixedSize})
	require.ErrorIs(t, err, ErrPortInUse)
	require.ErrorContains(t, err, config.EnvLeaderZMQPubPort)

	// In-process: the same endpoint held twice in one process.
	iep := Endpoint{Host: t.Name(), PubPort: 56001, AckPort: 56002}
	a, err := Listen(CoordinatorOptions{NumWorkers: 1, Endpoint: iep, Size: fixedSize})
	require.NoError(t, err)
	require.Equal(t, TransportInProc, a.Transport())
	_, err = Listen(CoordinatorOptions{NumWorkers: 1, Endpoint: iep, Size: fixedSize})
	require.ErrorIs(t, err, ErrPortInUse)
	require.NoError(t, a.Close())
	b, err := Listen(CoordinatorOptions{NumWorkers: 1, Endpoint: iep, Size: fixedSize})
	require.NoError(t, err, "a closed in-process leader frees its endpoint")
	require.NoError(t, b.Close())
}

func TestSamePorts(t *testing.T) {
	_, err := Listen(CoordinatorOptions{NumWorkers: 2, Endpoint: Endpoint{PubPort: 5000, AckPort: 5000}, Transport: TransportTCP, Size: fixedSize})
	require.ErrorContains(t, err, "must differ")
}

func TestWorkerSeesLeaderClose(t *testing.T) {
	for _, tr := range []Transport{TransportInProc, TransportTCP} {
		t.Run(tr.String(), func(t *testing.T) {
			c := newCluster(t, tr, 1)
			w := c.connect(t, 0, nil)
			l := c.listen(t, nil)
			_, err := l.Handshake(ctxTimeout(t, 5*time.Second))
			require.NoError(t, err)
			require.NoError(t, l.Close())
			select {
			case <-w.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("worker did not notice the leader closing")
			}
			require.ErrorIs(t, w.Err(), errLeaderGone)
			require.ErrorIs(t, l.Broadcast(context.Background(), nil), ErrClosed)
		})
	}
}

func TestParseTransport(t *testing.T) {
	for in, want := range map[string]Transport{"": TransportAuto, "auto": TransportAuto, "TCP": TransportTCP, "inproc": TransportInProc} {
		got, err := ParseTransport(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	_, err := ParseTransport("udp")
	require.ErrorContains(t, err, `"udp"`)
	require.Equal(t, TransportInProc, TransportAuto.resolve(1))
	require.Equal(t, TransportTCP, TransportAuto.resolve(2))
	require.Equal(t, TransportTCP, TransportTCP.resolve(1))
}

func TestConnectValidates(t *testing.T) {
	ok := MemberOptions{Rank: 0, WorldSize: 1, BytesPerBlock: 1, Allocate: func(LeaderMetadata) error { return nil }, Execute: func(context.Context, []byte) error { return nil }}
	for name, mod := range map[string]func(*MemberOptions){
		"rank too big":  func(o *MemberOptions) { o.Rank = 1 },
		"no world":      func(o *MemberOptions) { o.WorldSize = 0 },
		"no bpb":        func(o *MemberOptions) { o.BytesPerBlock = 0 },
		"no callbacks":  func(o *MemberOptions) { o.Execute = nil },
		"negative rank": func(o *MemberOptions) { o.Rank = -1 },
	} {
		o := ok
		mod(&o)
		_, err := Connect(o)
		require.Error(t, err, name)
	}
}

// TestWorkerCloseSaysGoodbye: an engine shutting down closes its workers
// first; the leader records the departure without reporting a failure.
func TestWorkerCloseSaysGoodbye(t *testing.T) {
	c := newCluster(t, TransportTCP, 2)
	for r := range 2 {
		c.connect(t, r, nil)
	}
	l := c.listen(t, func(o *CoordinatorOptions) { o.PingInterval = 50 * time.Millisecond })
	_, err := l.Handshake(ctxTimeout(t, 10*time.Second))
	require.NoError(t, err)
	require.NoError(t, c.ranks[1].w.Close())
	checkFor(t, 5*time.Second, func() bool { return len(l.DeadRanks()) == 1 }, "rank 1 recorded as gone")
	require.Equal(t, []int{1}, l.DeadRanks())
	require.Contains(t, c.logs.String(), "kvbm worker rank closed")
	require.NotContains(t, c.logs.String(), "not answering")
}

// TestHandshakeInSlices: a caller's deadline shorter than InitTimeout ends
// the wait with ErrHandshakePending; a later call resumes the same
// handshake, which InitTimeout bounds from the first call.
func TestHandshakeInSlices(t *testing.T) {
	c := newCluster(t, TransportTCP, 1)
	l := c.listen(t, func(o *CoordinatorOptions) { o.InitTimeout = time.Minute })
	_, err := l.Handshake(ctxTimeout(t, 100*time.Millisecond))
	require.ErrorIs(t, err, ErrHandshakePending)
	require.NotErrorIs(t, err, ErrHandshakeTimeout)
	c.connect(t, 0, nil)
	hs, err := l.Handshake(ctxTimeout(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, 1, hs.NumWorkers)
}

// TestWorkerCloseCancelsExecute: Close cancels the context of an operation
// still running in Execute and returns only once it returned, so nothing
// keeps running on the rank after its side channel closed.
func TestWorkerCloseCancelsExecute(t *testing.T) {
	c := newCluster(t, TransportInProc, 1)
	entered := make(chan struct{})
	returned := make(chan error, 1)
	w := c.connect(t, 0, func(o *MemberOptions) {
		o.Execute = func(ctx context.Context, step []byte) error {
			close(entered)
			<-ctx.Done() // an operation waiting for an engine step that never comes
			returned <- ctx.Err()
			return ctx.Err()
		}
	})
	l := c.listen(t, nil)
	_, err := l.Handshake(ctxTimeout(t, 10*time.Second))
	require.NoError(t, err)
	_, err = w.WaitReady(ctxTimeout(t, 5*time.Second))
	require.NoError(t, err)

	bctx, cancel := context.WithCancel(t.Context())
	broadcastDone := make(chan struct{})
	go func() {
		defer close(broadcastDone)
		_ = l.Broadcast(bctx, []byte("waits"))
	}()
	select {
	case <-entered:
	case <-time.After(time.Minute):
		t.Fatal("the operation never reached Execute")
	}
	require.NoError(t, w.Close())
	select {
	case err := <-returned:
		require.ErrorIs(t, err, context.Canceled)
	default:
		t.Fatal("Close returned while Execute was still running")
	}
	cancel()
	<-broadcastDone
}
