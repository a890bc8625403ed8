package consolidator

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
)

// enginePub is a test engine: a ZMQ PUB bound on a free port.
func enginePub(t testing.TB, ep string) (zmq4.Socket, string) {
	t.Helper()
	pub := zmq4.NewPub(context.Background())
	require.NoError(t, pub.Listen(ep))
	t.Cleanup(func() { _ = pub.Close() })
	return pub, "tcp://" + pub.Addr().String()
}

// collect reads consolidated messages until n events arrived; it checks
// that sequence numbers count up from want[0] without gaps.
func collect(t testing.TB, msgs <-chan zmq4.Msg, n int, nextSeq *uint64) []events.EngineEvent {
	t.Helper()
	var out []events.EngineEvent
	for len(out) < n {
		m := recvWithTimeout(t, msgs)
		require.Len(t, m.Frames, 3)
		require.Empty(t, m.Frames[0], "topic")
		require.Equal(t, *nextSeq, binary.BigEndian.Uint64(m.Frames[1]), "sequence numbers have no gaps")
		*nextSeq++
		b, err := events.DecodeMessage(m.Frames)
		require.NoError(t, err)
		require.Empty(t, b.Skipped)
		require.True(t, b.HasDPRank)
		require.Equal(t, 0, b.DPRank)
		out = append(out, b.Events...)
	}
	require.Len(t, out, n, "no more events than expected")
	return out
}

func waitIn(t testing.TB, c *Consolidator, n uint64) {
	t.Helper()
	checkFor(t, 10*time.Second, 2*time.Millisecond, func() error {
		if got := c.Stats().EventsIn; got != n {
			return fmt.Errorf("events in: %d, want %d", got, n)
		}
		return nil
	})
}

// TestZMQEndToEnd: a test engine PUB → consolidator (+ kvbm events through
// the Sink) → a test SUB, decoding what comes out.
func TestZMQEndToEnd(t *testing.T) {
	pub, ep := enginePub(t, "tcp://127.0.0.1:0")
	rec := &logRecorder{}
	m := metrics.New()
	c, err := New(Config{EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0",
		Logger: slog.New(rec), Metrics: m})
	require.NoError(t, err)
	defer c.Close()
	out := startSub(t, c.ZMQEndpoint())
	waitSubscribed(t, pub)
	waitSubscribed(t, c.pub)
	var seq uint64

	send := func(frames ...[]byte) {
		require.NoError(t, pub.Send(zmq4.NewMsgFrom(frames...)))
	}
	seqFrame := func(n uint64) []byte {
		b := make([]byte, 8)
		binary.BigEndian.PutUint64(b, n)
		return b
	}

	// 1. vLLM (array events, 3 frames): two blocks in one event.
	send([]byte("kv"), seqFrame(0), mustPack(t, []any{1.0, []any{
		[]any{"BlockStored", u64s(10, 11), nil, anyTokens(tokA, tokB), 4, nil, "GPU", nil, []any{nil, nil}, 0},
	}, nil}))
	got := collect(t, out, 2, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{10}, TokenIDs: tokA, BlockSize: 4}, got[0])
	require.Equal(t, events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{11}, ParentHash: 10, HasParent: true,
		TokenIDs: tokB, BlockSize: 4}, got[1])

	// 2. kvbm registers the same blocks in G2: deduplicated, nothing out.
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 90, Tokens: tokA, BlockSize: 4})
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 91, Parent: 90, HasParent: true, Tokens: tokB, BlockSize: 4})
	waitIn(t, c, 4)

	// 3. vLLM ≥ mid-2026 (map events, 2 frames): a child of engine block 11.
	send([]byte{}, mustPack(t, []any{2.0, []any{
		map[string]any{"type": "BlockStored", "block_hashes": u64s(12), "parent_block_hash": uint64(11),
			"token_ids": anyTokens(tokC), "block_size": 4, "medium": "GPU"},
	}, 0}))
	got = collect(t, out, 1, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{12}, ParentHash: 11, HasParent: true,
		TokenIDs: tokC, BlockSize: 4}, got[0])

	// 4. Garbage, a bad frame count, and a batch with one bad event: the
	// good event (engine evicts 10 and 11) is applied, silently, since
	// kvbm still holds both.
	send([]byte{}, []byte{0xc1, 0xff})
	send([]byte{}, []byte{}, []byte{}, []byte{})
	send([]byte{}, mustPack(t, []any{3.0, []any{
		[]any{"BlockStored", u64s(13), nil, anyTokens(tokA), 0},
		[]any{"BlockRemoved", u64s(10, 11), "GPU"},
	}, 0}))
	waitIn(t, c, 7)

	// 5. kvbm evicts block 91 from G2: its last holder, so REMOVE under
	// the first hash (the engine's 11).
	c.Publish(events.BlockEvent{Removed: true, Holder: host, SeqHash: 91})
	got = collect(t, out, 1, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{11}}, got[0])

	// 6. The engine resets its prefix cache: block 12, which only the
	// engine held, is removed; block 10 stays (kvbm's G2 holds it): no CLEAR.
	send([]byte{}, mustPack(t, []any{4.0, []any{[]any{"AllBlocksCleared"}}, 0}))
	got = collect(t, out, 1, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{12}}, got[0])

	st := c.Stats()
	require.Equal(t, uint64(9), st.EventsIn)
	require.Equal(t, uint64(3), st.Invalid, "garbage, frame count, block_size 0")
	require.Equal(t, uint64(4), st.Deduplicated, "two kvbm stores, two engine removes")
	require.Equal(t, uint64(5), st.ZMQEvents)
	require.Equal(t, 1, st.Tracked, "block 10, in kvbm's G2")
	require.Equal(t, 9.0, testutil.ToFloat64(m.EventsIn))
	require.Equal(t, 5.0, testutil.ToFloat64(m.EventsOut))
	require.Equal(t, 4.0, testutil.ToFloat64(m.EventsDeduped))
	require.Equal(t, 3.0, testutil.ToFloat64(m.EventsInvalid))

	kA := keyOf(tokA)
	require.NotEmpty(t, rec.grep(fmt.Sprintf("DEDUP: Block 10 (seq_hash=%d) added to source KvbmHost", kA)))
	require.NotEmpty(t, rec.grep(fmt.Sprintf("Block 11 (seq_hash=%d) removed from last source KvbmHost, will publish REMOVE event", keyOf(tokA, tokB))))
	require.NotEmpty(t, rec.grep("Failed to deserialize event batch"))
	require.NotEmpty(t, rec.grep("invalid block_size 0"))
	require.NotEmpty(t, rec.grep("successfully connected to "+ep))
}

// TestZMQEngineRestart: the engine goes away and comes back on the same
// port; the consolidator reconnects by itself. It also starts before the
// engine exists.
func TestZMQEngineRestart(t *testing.T) {
	// Reserve a port, then let the consolidator start with nobody there.
	probe, ep := enginePub(t, "tcp://127.0.0.1:0")
	require.NoError(t, probe.Close())

	rec := &logRecorder{}
	c, err := New(Config{EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0", Logger: slog.New(rec),
		ReconnectMin: 5 * time.Millisecond, ReconnectMax: 20 * time.Millisecond})
	require.NoError(t, err)
	defer c.Close()
	out := startSub(t, c.ZMQEndpoint())
	waitSubscribed(t, c.pub)
	var seq uint64

	for round := range 2 {
		pub, _ := enginePub(t, ep)
		waitSubscribed(t, pub)
		h := uint64(100 + round)
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte{}, mustPack(t, []any{1.0, []any{
			[]any{"BlockStored", u64s(h), nil, anyTokens([]uint32{uint32(round), 1, 2, 3}), 4},
		}, 0}))))
		got := collect(t, out, 1, &seq)
		require.Equal(t, []uint64{h}, got[0].BlockHashes)
		require.NoError(t, pub.Close())
		checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
			if len(rec.grep("lost "+ep)) < round+1 {
				return errString("consolidator has not noticed the engine left")
			}
			return nil
		})
	}
	require.NotEmpty(t, rec.grep("cannot connect to "+ep+" yet"))
}

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		msg  string
	}{
		{"no output", Config{}, "no output configured"},
		{"bad input scheme", Config{ZMQBind: "tcp://127.0.0.1:0", EngineEndpoints: []string{"http://x:1"}}, "unsupported transport"},
		{"input without scheme", Config{ZMQBind: "tcp://127.0.0.1:0", EngineEndpoints: []string{"localhost:5557"}}, "not a ZMQ endpoint"},
		{"input port 0", Config{ZMQBind: "tcp://127.0.0.1:0", EngineEndpoints: []string{"tcp://127.0.0.1:0"}}, "not in 1..65535"},
		{"output port out of range", Config{ZMQBind: "tcp://0.0.0.0:70000"}, "not in 0..65535"},
		{"nats namespace with a space", Config{NATSURL: "nats://127.0.0.1:1", Namespace: "my ns", Component: "backend"}, "NATS namespace"},
		{"nats component with a dot", Config{NATSURL: "nats://127.0.0.1:1", Namespace: "dynamo", Component: "a.b"}, "NATS component"},
		{"negative buffer", Config{ZMQBind: "tcp://127.0.0.1:0", BufferLimit: -1}, "buffer limit -1"},
		{"bad engine", Config{ZMQBind: "tcp://127.0.0.1:0", Engine: 7}, "is not vLLM, TensorRT-LLM or SGLang"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := New(tc.cfg)
			require.Error(t, err)
			require.Nil(t, c)
			require.Contains(t, err.Error(), tc.msg)
		})
	}

	// A busy output port is a startup error that names the setting.
	c1, err := New(Config{ZMQBind: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	defer c1.Close()
	_, err = New(Config{ZMQBind: c1.ZMQEndpoint()})
	require.Error(t, err)
	require.Contains(t, err.Error(), "DYN_KVBM_LEADER_ZMQ_PUB_PORT")

	// "*" hosts are accepted as libzmq does.
	ep, err := normalizeEndpoint("x", "tcp://*:5557", "127.0.0.1", false)
	require.NoError(t, err)
	require.Equal(t, "tcp://127.0.0.1:5557", ep)
}

// TestCloseIsCleanAndIdempotent: Close stops the goroutines even with an
// engine endpoint that never answers, and Publish afterwards is ignored.
func TestCloseIsCleanAndIdempotent(t *testing.T) {
	c, err := New(Config{EngineEndpoints: []string{"tcp://127.0.0.1:1"}, ZMQBind: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 1, Tokens: tokA, BlockSize: 4})
	require.NoError(t, c.Close())
	require.NoError(t, c.Close())
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 2, Tokens: tokB, BlockSize: 4})
	require.Equal(t, uint64(1), c.Stats().EventsIn)
}
