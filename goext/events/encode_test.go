package events

import (
	"encoding/binary"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func TestZMQFrames(t *testing.T) {
	fr := ZMQFrames(0x0102030405060708, []byte{0x90})
	require.Len(t, fr, 3)
	require.Empty(t, fr[0], "topic is empty")
	require.Equal(t, []byte{1, 2, 3, 4, 5, 6, 7, 8}, fr[1])
	require.Equal(t, uint64(0x0102030405060708), binary.BigEndian.Uint64(fr[1]))
	require.Equal(t, []byte{0x90}, fr[2])
}

// TestEncodeZMQPayloadPositions checks the wire shape positionally, as a
// reader that expects lora_id at index 5 sees it.
func TestEncodeZMQPayloadPositions(t *testing.T) {
	big := uint64(1)<<63 + 99
	evs := []ConsolidatedEvent{
		{Kind: KindStored, BlockHash: big, ParentHash: 7, HasParent: true, TokenIDs: []uint32{1, 2, 70000, 4}, BlockSize: 4, LoraName: "ad"},
		{Kind: KindStored, BlockHash: 8, TokenIDs: []uint32{5, 6, 7, 8}, BlockSize: 4},
		{Kind: KindRemoved, BlockHash: big},
		{Kind: KindCleared},
	}
	payload := EncodeZMQPayload(12.5, evs)

	var generic []any
	require.NoError(t, msgpack.Unmarshal(payload, &generic))
	require.Len(t, generic, 3)
	require.InDelta(t, 12.5, generic[0], 1e-9)
	require.EqualValues(t, 0, generic[2], "data_parallel_rank is 0")
	list := generic[1].([]any)
	require.Len(t, list, 4)

	s0 := list[0].([]any)
	require.Len(t, s0, 8)
	require.Equal(t, "BlockStored", s0[0])
	require.EqualValues(t, []any{big}, s0[1])
	require.EqualValues(t, 7, s0[2])
	require.EqualValues(t, []any{int8(1), int8(2), uint32(70000), int8(4)}, s0[3])
	require.EqualValues(t, 4, s0[4])
	require.Nil(t, s0[5], "lora_id is nil at index 5")
	require.Nil(t, s0[6], "medium is nil")
	require.Equal(t, "ad", s0[7])

	s1 := list[1].([]any)
	require.Nil(t, s1[2], "no parent")
	require.Nil(t, s1[7], "no lora")

	require.Equal(t, []any{"BlockRemoved", []any{big}, nil}, list[2])
	require.Equal(t, []any{"AllBlocksCleared"}, list[3])

	// And our own decoder reads it back.
	b, err := DecodeMessage(ZMQFrames(3, payload))
	require.NoError(t, err)
	require.Empty(t, b.Skipped)
	require.Equal(t, []EngineEvent{
		{Kind: KindStored, BlockHashes: []uint64{big}, ParentHash: 7, HasParent: true, TokenIDs: []uint32{1, 2, 70000, 4}, BlockSize: 4, LoraName: "ad"},
		{Kind: KindStored, BlockHashes: []uint64{8}, TokenIDs: []uint32{5, 6, 7, 8}, BlockSize: 4},
		{Kind: KindRemoved, BlockHashes: []uint64{big}},
		{Kind: KindCleared},
	}, b.Events)
	require.Equal(t, uint64(3), b.Seq)
}

func TestEncodeZMQPayloadGolden(t *testing.T) {
	// Byte-exact form of a small batch, so that a change of encoding is a
	// deliberate act: fixarray(3), float64 ts, fixarray(1) of
	// ["BlockRemoved", [5], nil], then 0.
	got := EncodeZMQPayload(0, []ConsolidatedEvent{{Kind: KindRemoved, BlockHash: 5}})
	want := []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x93, 0xac}
	want = append(want, "BlockRemoved"...)
	want = append(want, 0x91, 0x05, 0xc0, 0x00)
	require.Equal(t, want, got)
}

func TestRouterEventJSON(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   ConsolidatedEvent
		want string
	}{
		{
			"stored with parent",
			ConsolidatedEvent{Kind: KindStored, BlockHash: 18446744073709551615, ParentHash: 3, HasParent: true, TokensHash: 15310707395893867146},
			`{"worker_id":9,"storage_tier":"device","event":{"event_id":4,"data":{"stored":{"parent_hash":3,"blocks":[{"block_hash":18446744073709551615,"tokens_hash":15310707395893867146}]}},"dp_rank":0}}`,
		},
		{
			"stored at sequence start",
			ConsolidatedEvent{Kind: KindStored, BlockHash: 1, TokensHash: 2},
			`{"worker_id":9,"storage_tier":"device","event":{"event_id":4,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":1,"tokens_hash":2}]}},"dp_rank":0}}`,
		},
		{
			"removed",
			ConsolidatedEvent{Kind: KindRemoved, BlockHash: 1},
			`{"worker_id":9,"storage_tier":"device","event":{"event_id":4,"data":{"removed":{"block_hashes":[1]}},"dp_rank":0}}`,
		},
		{
			"cleared",
			ConsolidatedEvent{Kind: KindCleared},
			`{"worker_id":9,"storage_tier":"device","event":{"event_id":4,"data":"cleared","dp_rank":0}}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			re := NewRouterEvent(9, 4, &tc.ev)
			b, err := json.Marshal(re)
			require.NoError(t, err)
			require.JSONEq(t, tc.want, string(b))
			require.Equal(t, tc.want, string(b), "field order as the reference's serde output")

			var back RouterEvent
			require.NoError(t, json.Unmarshal(b, &back))
			require.Equal(t, re, back)
		})
	}
}

func TestRouterEventDataErrors(t *testing.T) {
	_, err := json.Marshal(KvCacheEventData{})
	require.Error(t, err)
	for _, in := range []string{`"wiped"`, `{"stored":{},"removed":{}}`, `{"moved":{}}`, `[1]`, `{"stored":5}`} {
		var d KvCacheEventData
		require.Error(t, json.Unmarshal([]byte(in), &d), in)
	}
}

func TestSubjectAndSlug(t *testing.T) {
	require.Equal(t, "namespace.dynamo.component.backend.kv-events", Subject("dynamo", "backend"))
	require.Equal(t, "namespace.dynamo.component.tensorrt_llm.kv_events", SubjectWithSuffix("dynamo", "tensorrt_llm", LegacyKVEventSubject))
	require.Equal(t, "namespace-dynamo-component-backend-kv-events", StreamName(Subject("dynamo", "backend")))
	require.Equal(t, "namespace-dyn-component-tensorrt-llm-kv-events", StreamName(Subject("Dyn", "tensorrt_llm")))
	require.Equal(t, "a_b_c-d", Slugify("__A.b c-d"))
	require.Equal(t, "x_", Slugify("_x\u00e9"))

	require.NoError(t, ValidateSubjectToken("namespace", "dynamo"))
	for _, bad := range []string{"", "a.b", "a*", ">", "a b"} {
		require.Error(t, ValidateSubjectToken("namespace", bad), bad)
	}
}
