package wire

import (
	"bytes"
	"context"
	"encoding/binary"
	"github.com/kvbm/kvbm/goext/integrity"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/worker"
)

// tokenEncodings are the byte patterns under which token id v could appear
// in a frame: little-endian int32/int64 (kvbm's own records), big-endian
// int32/int64 and their msgpack forms (uint32 0xce, uint64 0xcf, int64 0xd3).
func tokenEncodings(v uint32) [][]byte {
	le4 := binary.LittleEndian.AppendUint32(nil, v)
	le8 := binary.LittleEndian.AppendUint64(nil, uint64(v))
	be4 := binary.BigEndian.AppendUint32(nil, v)
	be8 := binary.BigEndian.AppendUint64(nil, uint64(v))
	return [][]byte{le4, le8, be4, be8, append([]byte{0xce}, be4...), append([]byte{0xcf}, be8...),
		append([]byte{0xd3}, be8...)}
}

// TestSideChannelFramesCarryNoTokens: a raw subscriber on the leader's PUB
// port (any local process can be one: the channel is authenticated, not
// encrypted) records every frame of a session in which a request with
// distinctive token ids is saved to G2 and moved to a persistent G3 by
// background operations on a real worker. No frame holds any of the
// tokens, in any encoding, nor the blocks' sequence hashes or the request's
// id; the tier file still records the tokens, so a restarted worker
// recovers the blocks with them.
func TestSideChannelFramesCarryNoTokens(t *testing.T) {
	const hostBlocks, diskBlocks, nBlocks = 16, 16, 3
	g1, err := procG1(layout.CPUPaged, 0)
	require.NoError(t, err)
	dir := t.TempDir()
	wopts := worker.Options{Rank: 0, HostBlocks: hostBlocks, DiskBlocks: diskBlocks, DiskDir: dir,
		DisableODirect: true, DiskPersist: true, DiskKey: privacyDiskKey(t),
		Fingerprint: fingerprint.FromEngine("privacy-test", "torch.float16", g1, 1, 0)}
	w, err := worker.New(wopts)
	require.NoError(t, err)
	closeW := sync.OnceValue(w.Close)
	t.Cleanup(func() { _ = closeW() })
	require.NoError(t, w.RegisterG1(g1))

	c := newCluster(t, TransportTCP, 1)
	co := c.listen(t, func(o *CoordinatorOptions) {
		o.Size = func(int64, int) (int, int, error) { return hostBlocks, diskBlocks, nil }
	})

	// The eavesdropper subscribes before anything is sent.
	var mu sync.Mutex
	var frames [][]byte
	var fns []string
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(co.Endpoint().PubURL()))
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		for {
			msg, err := sub.Recv()
			if err != nil || ctx.Err() != nil {
				return
			}
			mu.Lock()
			frames = append(frames, msg.Frames...)
			if len(msg.Frames) > 1 {
				fns = append(fns, string(msg.Frames[1]))
			}
			mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); _ = sub.Close(); <-recvDone })
	m, err := Connect(MemberOptions{
		Rank: 0, WorldSize: 1, NumDeviceBlocks: procBlocks, BytesPerBlock: g1.BytesPerBlock(), Endpoint: c.ep,
		Transport: c.tr, Secret: c.secret, Logger: testLogger(c.logs), RetryInterval: 20 * time.Millisecond,
		Allocate: ExpectSizes(hostBlocks, diskBlocks), Execute: RunOn(w),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	_, err = co.Handshake(ctxTimeout(t, 30*time.Second))
	require.NoError(t, err)
	// Wait until the subscriber hears the leader's pings (a PUB drops what
	// a subscriber that has not joined yet would have received).
	checkFor(t, 20*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(fns, fnPing)
	}, "the raw subscriber hears the leader")

	l, err := leader.New(leader.Options{
		Config: &config.Config{CPUCacheOverrideBlocks: hostBlocks, DiskCacheOverrideBlocks: diskBlocks,
			DiskPersist: true, DisableDiskOffloadFilter: true, CacheStatsMaxRequests: 100,
			CacheStatsLogInterval: time.Hour},
		BlockSize: procBS, BytesPerBlock: g1.BytesPerBlock(), NumWorkers: 1, SideChannel: co,
		Logger: testLogger(c.logs),
	})
	require.NoError(t, err)
	t.Cleanup(l.Close)

	// Distinctive token ids: none of their encodings occurs by chance.
	prompt := make([]uint32, nBlocks*procBS)
	for i := range prompt {
		prompt[i] = 0x5EC70000 + uint32(i)*0x0101
	}
	// The engine's step: the plan reaches the worker through the engine
	// (here: directly), as vLLM ships it inside the connector metadata.
	step, err := l.Step([]leader.RequestUpdate{{ReqID: "req-secret", NewTokens: prompt,
		NewBlockIDs: []int64{3, 4, 5}, NumScheduledTokens: len(prompt)}})
	require.NoError(t, err)
	require.NoError(t, w.BindStep(step))
	w.StartLoad()
	w.WaitForSave()
	checkFor(t, 30*time.Second, func() bool {
		st, _ := l.SideChannelStats()
		return st.Committed >= 1
	}, "the background operation moved the blocks to G3")
	_, disk := l.BlocksUsed()
	require.Equal(t, nBlocks, disk)

	// Idle steps and pings after the operation, then a clean shutdown.
	for range 2 {
		step, err := l.Step(nil)
		require.NoError(t, err)
		require.NoError(t, w.BindStep(step))
		w.WaitForSave()
	}
	l.Close()
	require.NoError(t, m.Close())
	require.NoError(t, co.Close())
	cancel()
	_ = sub.Close()
	<-recvDone

	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, fns, fnStep, "the subscriber saw the background operation")
	leaks := 0
	for _, f := range frames {
		for _, tok := range prompt {
			for _, enc := range tokenEncodings(tok) {
				if bytes.Contains(f, enc) {
					leaks++
					t.Errorf("a side-channel frame (%d bytes) holds token %#x as % x", len(f), tok, enc)
				}
			}
		}
	}
	// Nor the blocks' sequence hashes (hashes of the prompt), nor the
	// request's id.
	for _, h := range hashing.SequenceHashes(prompt, procBS, hashing.DefaultSaltHash, nil) {
		for _, enc := range [][]byte{binary.LittleEndian.AppendUint64(nil, h), binary.BigEndian.AppendUint64(nil, h)} {
			for _, f := range frames {
				if bytes.Contains(f, enc) {
					leaks++
					t.Errorf("a side-channel frame (%d bytes) holds sequence hash %#x", len(f), h)
				}
			}
		}
	}
	for _, f := range frames {
		if bytes.Contains(f, []byte("req-secret")) {
			leaks++
			t.Errorf("a side-channel frame holds the request id")
		}
	}
	t.Logf("frames captured: %d (functions %v); request contents found: %d", len(frames), slices.Compact(slices.Clone(fns)), leaks)

	// The tier file still records the tokens: a restarted worker recovers
	// every block with its own.
	require.NoError(t, closeW())
	w2, err := worker.New(wopts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = w2.Close() })
	require.NoError(t, w2.RegisterG1(g1))
	rec := w2.Recovered()
	require.Len(t, rec.Blocks, nBlocks)
	var got []uint32
	for _, b := range rec.Blocks {
		got = append(got, b.Tokens...)
	}
	slices.Sort(got)
	require.Equal(t, prompt, got)
}

// privacyDiskKey keys the persistent tiers of this test (an override: no
// per-user secret is created).
func privacyDiskKey(t *testing.T) integrity.Key {
	k, err := integrity.LocalKey([]byte("wire privacy test storage secret"), "")
	require.NoError(t, err)
	return k
}
