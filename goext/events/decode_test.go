package events

import (
	"encoding/binary"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// pack encodes v with msgpack; []any become arrays, map[string]any maps.
func pack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

func seqFrame(n uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, n)
	return b
}

func iota32(from, n int) []any {
	out := make([]any, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}

func u32s(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// vllmArrayStored is a BlockStored as vLLM encoded it before mid-2026
// (array_like, every position present, including the 2026 additions).
func vllmArrayStored(hashes []any, parent any, tokens []any, bs int) []any {
	return []any{"BlockStored", hashes, parent, tokens, bs, nil, "GPU", nil,
		[]any{nil, nil}, 0, "full_attention", nil}
}

func TestDecodeVllmArrayBatch(t *testing.T) {
	big := uint64(1)<<63 + 12345
	payload := pack(t, []any{
		1718000000.5,
		[]any{
			vllmArrayStored([]any{uint64(11), big}, nil, iota32(0, 8), 4),
			[]any{"BlockRemoved", []any{uint64(11)}, "GPU", 0},
			[]any{"AllBlocksCleared"},
		},
		nil,
	})
	b, err := DecodeMessage([][]byte{[]byte("kv"), seqFrame(7), payload})
	require.NoError(t, err)
	require.Empty(t, b.Skipped)
	require.True(t, b.HasSeq)
	require.Equal(t, uint64(7), b.Seq)
	require.Equal(t, []byte("kv"), b.Topic)
	require.InDelta(t, 1718000000.5, b.TS, 1e-6)
	require.False(t, b.HasDPRank)
	require.Len(t, b.Events, 3)

	st := b.Events[0]
	require.Equal(t, KindStored, st.Kind)
	require.Equal(t, []uint64{11, big}, st.BlockHashes)
	require.False(t, st.HasParent)
	require.Equal(t, 4, st.BlockSize)
	require.Equal(t, "GPU", st.Medium)
	require.Equal(t, "", st.LoraName)
	require.Equal(t, u32s(0, 4), st.Block(0))
	require.Equal(t, u32s(4, 4), st.Block(1))
	p, ok := st.Parent(1)
	require.True(t, ok)
	require.Equal(t, uint64(11), p)

	require.Equal(t, 0, st.Group)
	require.True(t, st.HasGroup)
	require.Equal(t, "full_attention", st.GroupKind)
	require.Equal(t, EngineEvent{Kind: KindRemoved, BlockHashes: []uint64{11}, Medium: "GPU", HasGroup: true}, b.Events[1])
	require.Equal(t, EngineEvent{Kind: KindCleared}, b.Events[2])
}

func TestDecodeVllmMapEvents(t *testing.T) {
	// vLLM after PR #42892: tagged maps with defaults omitted; the batch
	// itself stays an array.
	payload := pack(t, []any{
		1.0,
		[]any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(5)},
				"parent_block_hash": uint64(4), "token_ids": iota32(100, 16), "block_size": 16,
				"medium": "GPU", "lora_name": "ad1", "extra_keys": []any{nil}, "group_idx": 0,
				"kv_cache_spec_kind": "full_attention"},
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{uint64(5)}, "medium": "GPU"},
			map[string]any{"type": "AllBlocksCleared"},
		},
		3,
	})
	b, err := DecodeMessage([][]byte{{}, payload})
	require.NoError(t, err)
	require.Empty(t, b.Skipped)
	require.False(t, b.HasSeq)
	require.True(t, b.HasDPRank)
	require.Equal(t, 3, b.DPRank)
	require.Len(t, b.Events, 3)
	require.Equal(t, EngineEvent{Kind: KindStored, BlockHashes: []uint64{5}, ParentHash: 4, HasParent: true,
		TokenIDs: u32s(100, 16), BlockSize: 16, LoraName: "ad1", Medium: "GPU", HasGroup: true,
		GroupKind: "full_attention"}, b.Events[0])
	require.Equal(t, KindRemoved, b.Events[1].Kind)
	require.Equal(t, KindCleared, b.Events[2].Kind)
}

func TestDecodeMapBatch(t *testing.T) {
	payload := pack(t, map[string]any{
		"ts":                 2.5,
		"events":             []any{[]any{"AllBlocksCleared"}},
		"data_parallel_rank": 1,
		"future_field":       []any{1, 2, map[string]any{"x": 1}},
	})
	b, err := DecodeMessage([][]byte{{}, seqFrame(0), payload})
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	require.Equal(t, 1, b.DPRank)
	require.InDelta(t, 2.5, b.TS, 1e-9)
}

func TestDecodeTrtllmPublisherShape(t *testing.T) {
	// Our TensorRT-LLM ZmqKvEventPublisher (design §6.2): one event per
	// batch, map events, hashes ≥ 2^63 sent as two's-complement i64.
	h1 := uint64(0xfedcba9876543210)
	h2 := uint64(42)
	stored := pack(t, []any{1.0, []any{map[string]any{
		"type": "BlockStored", "block_hashes": []any{int64(h1), int64(h2)},
		"parent_block_hash": int64(-2), "token_ids": iota32(0, 64), "block_size": 32,
	}}, 0})
	removed := pack(t, []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": []any{int64(h1)}}}, 0})
	cleared := pack(t, []any{1.0, []any{map[string]any{"type": "AllBlocksCleared"}}, 0})

	dec := NewDecoder()
	b, err := dec.DecodeMessage([][]byte{[]byte("topic"), seqFrame(1), stored})
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	ev := b.Events[0]
	require.Equal(t, []uint64{h1, h2}, ev.BlockHashes)
	require.True(t, ev.HasParent)
	require.Equal(t, uint64(math.MaxUint64-1), ev.ParentHash)
	require.Equal(t, 32, ev.BlockSize)
	require.Len(t, ev.TokenIDs, 64)

	b, err = dec.DecodeMessage([][]byte{[]byte("topic"), seqFrame(2), removed})
	require.NoError(t, err)
	require.Equal(t, []uint64{h1}, b.Events[0].BlockHashes)

	b, err = dec.DecodeMessage([][]byte{[]byte("topic"), seqFrame(3), cleared})
	require.NoError(t, err)
	require.Equal(t, KindCleared, b.Events[0].Kind)
}

func TestDecodeHashEncodings(t *testing.T) {
	digest32 := make([]byte, 32)
	for i := range digest32 {
		digest32[i] = byte(i)
	}
	digest16 := digest32[:16]
	for _, tc := range []struct {
		name string
		hash any
		want uint64
	}{
		{"positive fixint", 7, 7},
		{"uint64 above 2^63", uint64(1<<63 + 1), 1<<63 + 1},
		{"max uint64", uint64(math.MaxUint64), math.MaxUint64},
		{"negative i64", int64(-1), math.MaxUint64},
		{"min i64", int64(math.MinInt64), 1 << 63},
		{"negative int8", int8(-3), math.MaxUint64 - 2},
		{"negative int32", int32(-70000), uint64(math.MaxUint64) - 69999},
		{"sha256 bytes: last 8 big-endian", digest32, 0x18191a1b1c1d1e1f},
		{"xxhash128 bytes", digest16, 0x08090a0b0c0d0e0f},
		{"short bytes", []byte{1, 2}, 0x0102},
	} {
		t.Run(tc.name, func(t *testing.T) {
			payload := pack(t, []any{0, []any{
				[]any{"BlockStored", []any{tc.hash}, tc.hash, iota32(0, 4), 4},
				[]any{"BlockRemoved", []any{tc.hash}},
			}, 0})
			b, err := DecodeMessage([][]byte{{}, payload})
			require.NoError(t, err)
			require.Empty(t, b.Skipped)
			require.Equal(t, []uint64{tc.want}, b.Events[0].BlockHashes)
			require.Equal(t, tc.want, b.Events[0].ParentHash)
			require.True(t, b.Events[0].HasParent)
			require.Equal(t, []uint64{tc.want}, b.Events[1].BlockHashes)
		})
	}
}

func TestDecodeOptionalAndTrailingFields(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   any
		want EngineEvent
	}{
		{
			"stored: only required fields",
			[]any{"BlockStored", []any{1}, nil, iota32(0, 2), 2},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1}, TokenIDs: u32s(0, 2), BlockSize: 2},
		},
		{
			"stored: lora_id only",
			[]any{"BlockStored", []any{1}, 9, iota32(0, 2), 2, 3},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1}, ParentHash: 9, HasParent: true, TokenIDs: u32s(0, 2), BlockSize: 2},
		},
		{
			"stored: lora_name and unknown trailing fields",
			[]any{"BlockStored", []any{1}, nil, iota32(0, 2), 2, nil, "CPU", "ad", []any{nil}, 1, "x", 5, map[string]any{"new": true}},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1}, TokenIDs: u32s(0, 2), BlockSize: 2, Medium: "CPU", LoraName: "ad",
				Group: 1, HasGroup: true, GroupKind: "x"},
		},
		{
			"stored: reference consolidator output with lora_name at index 5",
			[]any{"BlockStored", []any{1}, nil, iota32(0, 2), 2, "ad"},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1}, TokenIDs: u32s(0, 2), BlockSize: 2, LoraName: "ad"},
		},
		{
			"stored: last block partial (chunks, as the reference)",
			[]any{"BlockStored", []any{1, 2}, nil, iota32(0, 6), 4},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1, 2}, TokenIDs: u32s(0, 6), BlockSize: 4},
		},
		{
			"stored map: parent omitted",
			map[string]any{"type": "BlockStored", "block_hashes": []any{1}, "token_ids": iota32(0, 2), "block_size": 2},
			EngineEvent{Kind: KindStored, BlockHashes: []uint64{1}, TokenIDs: u32s(0, 2), BlockSize: 2},
		},
		{
			"removed: no medium",
			[]any{"BlockRemoved", []any{1, 2}},
			EngineEvent{Kind: KindRemoved, BlockHashes: []uint64{1, 2}},
		},
		{
			"removed: trailing group_idx and more",
			[]any{"BlockRemoved", []any{1}, nil, 0, "later"},
			EngineEvent{Kind: KindRemoved, BlockHashes: []uint64{1}, HasGroup: true},
		},
		{
			"removed: trailing ext values and strings",
			[]any{"BlockRemoved", []any{1}, nil, msgpackExt{}, "tail", []byte{1, 2, 3}},
			EngineEvent{Kind: KindRemoved, BlockHashes: []uint64{1}},
		},
		{
			"cleared: trailing fields",
			[]any{"AllBlocksCleared", 1, []any{2}},
			EngineEvent{Kind: KindCleared},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := DecodeMessage([][]byte{{}, pack(t, []any{0.0, []any{tc.ev}, nil})})
			require.NoError(t, err)
			require.Empty(t, b.Skipped)
			require.Equal(t, []EngineEvent{tc.want}, b.Events)
		})
	}
}

// TestDecodeSkipsBadEvents: one malformed event is skipped with a reason;
// the events around it are kept.
func TestDecodeSkipsBadEvents(t *testing.T) {
	good := []any{"BlockRemoved", []any{77}}
	for _, tc := range []struct {
		name   string
		bad    any
		reason string
	}{
		{"token count mismatch", []any{"BlockStored", []any{1, 2}, nil, iota32(0, 4), 4}, "token chunks (1) don't match block hashes (2)"},
		{"too many tokens", []any{"BlockStored", []any{1}, nil, iota32(0, 5), 4}, "token chunks (2) don't match block hashes (1)"},
		{"block_size 0", []any{"BlockStored", []any{1}, nil, iota32(0, 4), 0}, "invalid block_size 0"},
		{"negative block_size", []any{"BlockStored", []any{1}, nil, iota32(0, 4), -4}, "invalid block_size -4"},
		{"block_size missing in map", map[string]any{"type": "BlockStored", "block_hashes": []any{1}, "token_ids": iota32(0, 4)}, "without block_size"},
		{"too few fields", []any{"BlockStored", []any{1}, nil, iota32(0, 4)}, "want at least 5"},
		{"unknown type", []any{"BlockUpdated", 1, 2}, "unknown event type \"BlockUpdated\""},
		{"unknown type in map", map[string]any{"type": "created", "x": []any{1}}, "unknown event type \"created\""},
		{"map without type", map[string]any{"block_hashes": []any{1}}, "no \"type\" key"},
		{"tag not a string", []any{5, []any{1}}, "tag is not a string"},
		{"empty array", []any{}, "empty event array"},
		{"event is a scalar", 12, "want array or map"},
		{"hash is a float", []any{"BlockRemoved", []any{1.5}}, "hash is msgpack float"},
		{"hash is nil", []any{"BlockRemoved", []any{1, nil}}, "block_hashes[1] is nil"},
		{"hashes not an array", []any{"BlockRemoved", "abc"}, "block_hashes is msgpack str"},
		{"removed without hashes", []any{"BlockRemoved"}, "no block_hashes"},
		{"negative token", []any{"BlockStored", []any{1}, nil, []any{1, -1}, 2}, "token_ids[1] is out of the u32 range"},
		{"token above u32", []any{"BlockStored", []any{1}, nil, []any{uint64(1) << 32, 1}, 2}, "token_ids[0] is out of the u32 range"},
		{"eagle bigrams", []any{"BlockStored", []any{1}, nil, []any{[]any{1, 2}, []any{3, 4}}, 2}, "token_ids[0] is msgpack array"},
		{"lora_name not a string", []any{"BlockStored", []any{1}, nil, iota32(0, 2), 2, nil, nil, 5}, "lora_name is msgpack int"},
		{"block_size is a string", []any{"BlockStored", []any{1}, nil, iota32(0, 2), "2"}, "block_size is msgpack str"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			payload := pack(t, []any{0.0, []any{good, tc.bad, good}, 0})
			b, err := DecodeMessage([][]byte{{}, payload})
			require.NoError(t, err)
			require.Len(t, b.Events, 2, "the good events around the bad one are kept")
			require.Len(t, b.Skipped, 1)
			require.Equal(t, 1, b.Skipped[0].Index)
			require.Contains(t, b.Skipped[0].Reason, tc.reason)
			for _, ev := range b.Events {
				require.Equal(t, []uint64{77}, ev.BlockHashes)
			}
		})
	}
}

func TestDecodeBatchErrors(t *testing.T) {
	valid := pack(t, []any{0.0, []any{}, 0})
	_, err := DecodeMessage([][]byte{valid})
	require.ErrorIs(t, err, ErrFrameCount)
	_, err = DecodeMessage([][]byte{{}, {}, valid, {}})
	require.ErrorIs(t, err, ErrFrameCount)

	for _, tc := range []struct {
		name    string
		payload []byte
		msg     string
	}{
		{"empty", nil, "empty payload"},
		{"scalar", pack(t, 5), "want array or map"},
		{"short array", pack(t, []any{1.0}), "array has 1 elements"},
		{"events not an array", pack(t, []any{1.0, "x", 0}), "events is msgpack str"},
		{"map without events", pack(t, map[string]any{"ts": 1.0}), "no \"events\" key"},
		{"truncated", valid[:len(valid)-1], "malformed msgpack"},
		{"truncated inside an event", pack(t, []any{0.0, []any{[]any{"BlockStored", []any{1}, nil, iota32(0, 40), 40}}, 0})[:30], "malformed msgpack"},
		{"huge declared array", []byte{0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x90}, "malformed msgpack"},
		// A skipped trailing field that claims 4 GiB: rejected at once, not
		// read into a buffer (a reused Decoder must not grow on lies).
		{"lying bin32 length", []byte{0x93, 0x00, 0x91, 0x92, 0xa2, 'x', 'y', 0xc6, 0xff, 0xff, 0xff, 0xff, 0x00}, "overruns"},
		{"lying ext32 length", []byte{0x93, 0x00, 0x91, 0x92, 0xa2, 'x', 'y', 0xc9, 0x7f, 0xff, 0xff, 0xff, 0x01}, "overruns"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeMessage([][]byte{{}, tc.payload})
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.msg)
			require.True(t, strings.HasPrefix(err.Error(), "events: "), "%q names its package first", err)
		})
	}
}

func TestDecodeSeqFrameNot8Bytes(t *testing.T) {
	b, err := DecodeMessage([][]byte{{}, {1, 2}, pack(t, []any{0.0, []any{}, 0})})
	require.NoError(t, err)
	require.False(t, b.HasSeq)
}

// TestDecoderReuse: a reused Decoder returns batches that do not alias its
// scratch buffers.
func TestDecoderReuse(t *testing.T) {
	dec := NewDecoder()
	mk := func(lora string, first int) []byte {
		return pack(t, []any{0.0, []any{[]any{"BlockStored", []any{first}, nil, iota32(first, 2), 2, nil, nil, lora}}, 0})
	}
	b1, err := dec.DecodePayload(mk("first-adapter", 1))
	require.NoError(t, err)
	b2, err := dec.DecodePayload(mk("second", 9))
	require.NoError(t, err)
	require.Equal(t, "first-adapter", b1.Events[0].LoraName)
	require.Equal(t, u32s(1, 2), b1.Events[0].TokenIDs)
	require.Equal(t, "second", b2.Events[0].LoraName)
}

// msgpackExt encodes as a msgpack ext value (type 5, 3 bytes), which no
// engine sends today; a future field of that kind must still be skipped.
type msgpackExt struct{}

func (msgpackExt) EncodeMsgpack(enc *msgpack.Encoder) error {
	if err := enc.EncodeExtHeader(5, 3); err != nil {
		return err
	}
	_, err := enc.Writer().Write([]byte{1, 2, 3})
	return err
}
