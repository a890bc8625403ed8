package consolidator

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/pagestore"
)

// sglangKey is an SGLang HiCache page key (64 hex digits) whose event hash
// (its first 16 digits) is ext.
func sglangKey(ext uint64) string { return fmt.Sprintf("%016x%048x", ext, ext^0x5a5a) }

// TestSGLangEventsJoinTheDiskTier: SGLang-format events (tagged maps, signed
// int64 hashes, medium GPU and CPU_PINNED) from a test engine, and a real
// page store (kvbm's HiCache L3) announcing its pages by SGLang's event hash
// through the consolidator: the router sees each block once, and a block's
// REMOVE only when neither SGLang's GPU, its host tier nor kvbm's disk tier
// holds it. L3 pages the engine never announced (no tokens) are not
// published.
func TestSGLangEventsJoinTheDiskTier(t *testing.T) {
	pub, ep := enginePub(t, "tcp://127.0.0.1:0")
	rec := &logRecorder{}
	c, err := New(Config{Engine: EngineSglang, EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0",
		Logger: slog.New(rec)})
	require.NoError(t, err)
	defer c.Close()
	dumpOnFail(t, c, rec)
	out := startSub(t, c.ZMQEndpoint())
	waitSubscribed(t, pub)
	waitSubscribed(t, c.pub)
	var seq uint64

	key, err := integrity.LocalKey([]byte("sglang events test"), "")
	require.NoError(t, err)
	ps, err := pagestore.Open(pagestore.Options{Dir: t.TempDir(), NumPages: 1, PageBytes: 64, Identity: "sglang-events",
		DisableODirect: true, Key: key, Events: c})
	require.NoError(t, err)
	defer ps.Close()
	put := func(k string) {
		sk := []byte(k)
		ok, err := ps.PutExt([]pagestore.Key{ps.Key(sk)}, []pagestore.Ext{pagestore.SGLangEventHash(sk)},
			[]pagestore.Page{{make([]byte, 64)}})
		require.NoError(t, err)
		require.Equal(t, []bool{true}, ok)
	}

	// Block hashes with the top bit set: SGLang publishes them as negative
	// int64 (hash_str_to_int64); the decoder bit-casts them back.
	const a, b, x = uint64(0xf00d000000000001), uint64(0x0123456789abcdef), uint64(0xdead00000000beef)
	send := func(ts float64, evs ...map[string]any) {
		list := make([]any, len(evs))
		for i, e := range evs {
			list[i] = e
		}
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte{}, mustPack(t, []any{ts, list, nil}))))
	}
	stored := func(medium string, parent any, hashes ...uint64) map[string]any {
		hs := make([]any, len(hashes))
		for i, h := range hashes {
			hs[i] = int64(h)
		}
		tokens := anyTokens(tokA, tokB)[:4*len(hashes)]
		ev := map[string]any{"type": "BlockStored", "block_hashes": hs, "token_ids": tokens, "block_size": 4,
			"lora_id": nil, "medium": medium}
		if parent != nil {
			ev["parent_block_hash"] = parent
		}
		return ev
	}
	removed := func(medium string, hashes ...uint64) map[string]any {
		hs := make([]any, len(hashes))
		for i, h := range hashes {
			hs[i] = int64(h)
		}
		return map[string]any{"type": "BlockRemoved", "block_hashes": hs, "medium": medium}
	}

	// 1. kvbm's L3 stores page a before the engine's events arrive (the
	// backup runs in SGLang's storage thread): it waits, nothing out.
	put(sglangKey(a))
	require.Equal(t, 1, locked(c, c.tr.Pending))

	// 2. SGLang's GPU cache stores a, b: two STOREs, under SGLang's hashes.
	send(1, stored("GPU", nil, a, b))
	got := collect(t, out, 2, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{a}, TokenIDs: tokA, BlockSize: 4}, got[0])
	require.Equal(t, events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{b}, ParentHash: a, HasParent: true,
		TokenIDs: tokB, BlockSize: 4}, got[1])
	require.Equal(t, 0, locked(c, c.tr.Pending), "the waiting L3 holder joined block a")
	require.Equal(t, []events.Holder{events.HolderEngine, events.HolderKvbmDisk}, locked(c, func() []events.Holder { return c.tr.Holders(a) }))

	// 3. HiCache backs a, b up to its host tier, then the GPU evicts them:
	// nothing out, both still held.
	send(2, stored("CPU_PINNED", nil, a, b), removed("GPU", a, b))
	waitIn(t, c, 7)
	require.Equal(t, []events.Holder{events.HolderKvbmDisk, events.HolderEngineHost}, locked(c, func() []events.Holder { return c.tr.Holders(a) }))

	// 4. The host tier evicts both: b has no holder left (REMOVE b); a stays
	// announced, kvbm's disk tier has it.
	send(3, removed("CPU_PINNED", a, b))
	got = collect(t, out, 1, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{b}}, got[0])

	// 5. The store (one page) takes page x, which the engine never announced:
	// a is evicted from L3 (REMOVE a); x waits, unpublished.
	put(sglangKey(x))
	got = collect(t, out, 1, &seq)
	require.Equal(t, events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{a}}, got[0])
	require.Equal(t, 1, locked(c, c.tr.Pending))
	require.Equal(t, 0, c.Stats().Tracked)

	// 6. Clearing the store drops x's waiting holder: no event, nothing left.
	require.NoError(t, ps.Clear())
	require.Equal(t, 0, locked(c, c.tr.Pending))
	st := c.Stats()
	require.Equal(t, uint64(4), st.ZMQEvents)
	require.Zero(t, st.UnknownRemoves)
	require.Zero(t, st.NotForwarded)
}

// locked calls f under the consolidator's lock (its tracker is not safe
// for concurrent use).
func locked[T any](c *Consolidator, f func() T) T {
	c.mu.Lock()
	defer c.mu.Unlock()
	return f()
}

// TestSGLangEventHash: the event hash of a page key is its first 16 hex
// digits, SGLang's hash_str_to_int64 bit-cast to unsigned.
func TestSGLangEventHash(t *testing.T) {
	require.Equal(t, pagestore.Ext{Hash: 0xf00d000000000001, OK: true}, pagestore.SGLangEventHash([]byte(sglangKey(0xf00d000000000001))))
	require.Equal(t, pagestore.Ext{Hash: 0xABCDEF0123456789, OK: true}, pagestore.SGLangEventHash([]byte("ABCDEF0123456789")))
	for _, k := range []string{"", "abc", "zzzzzzzzzzzzzzzzzzzz", "0123456789abcde-"} {
		require.False(t, pagestore.SGLangEventHash([]byte(k)).OK, k)
	}
}

// TestSGLangPassthroughIgnoresHostTier: in passthrough mode the router sees
// SGLang's GPU events only.
func TestSGLangPassthroughIgnoresHostTier(t *testing.T) {
	c, err := New(Config{Engine: EngineSglang, Mode: ModePassthrough, ZMQBind: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	defer c.Close()
	b := events.Batch{Events: []events.EngineEvent{
		{Kind: events.KindStored, BlockHashes: []uint64{1}, TokenIDs: tokA, BlockSize: 4, Medium: "GPU"},
		{Kind: events.KindStored, BlockHashes: []uint64{1}, TokenIDs: tokA, BlockSize: 4, Medium: "CPU_PINNED"},
	}}
	c.applyBatch(&b)
	require.Equal(t, 1, c.tr.Queued()+int(c.Stats().ZMQEvents))
	require.Equal(t, uint64(1), c.Stats().NotForwarded)
}

// TestSGLangPendingIsBounded: by-hash stores the engine never announces
// wait at most maxBlocks deep (the oldest go first), and a waiting store
// that the engine then announces joins its block.
func TestSGLangPendingIsBounded(t *testing.T) {
	tr := NewTracker(EngineSglang, nil, WithMaxBlocks(4))
	for h := uint64(1); h <= 10; h++ {
		tr.StoreByHash(h, events.HolderKvbmDisk)
	}
	require.Equal(t, 4, tr.Pending())
	require.Zero(t, tr.Queued(), "nothing announced without the engine")
	tr.ApplyEngine(&events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{1, 10}, TokenIDs: anyTokensU(8),
		BlockSize: 4, Medium: "GPU"})
	require.Equal(t, []events.Holder{events.HolderEngine}, tr.Holders(1), "1 was forgotten")
	require.Equal(t, []events.Holder{events.HolderEngine, events.HolderKvbmDisk}, tr.Holders(10))
	require.Equal(t, 3, tr.Pending())
	tr.ApplyEngine(&events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{10}, Medium: "GPU"})
	require.Equal(t, 2, tr.Queued(), "two STOREs, no REMOVE: the disk tier holds 10")
	tr.ApplyKvbm(&events.BlockEvent{Removed: true, Holder: events.HolderKvbmDisk, SeqHash: 9, ByHash: true})
	require.Equal(t, 2, tr.Pending())
	tr.ClearHolder(events.HolderKvbmDisk)
	require.Zero(t, tr.Pending())
}

func anyTokensU(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(100 + i)
	}
	return out
}
