package events

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// seedPayloads are real-shaped engine messages: vLLM array events (old),
// vLLM map events (new), map batches, our TensorRT-LLM publisher's events,
// bytes hashes, and our own consolidated output.
func seedPayloads(t testing.TB) [][]byte {
	return [][]byte{
		pack(t, []any{1718000000.25, []any{
			vllmArrayStored([]any{uint64(1) << 63, 2}, nil, iota32(0, 32), 16),
			[]any{"BlockRemoved", []any{2}, "GPU", 0},
			[]any{"AllBlocksCleared"},
		}, nil}),
		pack(t, []any{1.0, []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{5}, "parent_block_hash": 4,
				"token_ids": iota32(0, 16), "block_size": 16, "medium": "GPU", "extra_keys": []any{nil}},
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{5}},
		}, 2}),
		pack(t, map[string]any{"ts": 1.0, "events": []any{[]any{"AllBlocksCleared"}}, "data_parallel_rank": 0}),
		pack(t, []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{int64(-5), int64(7)},
			"parent_block_hash": nil, "token_ids": iota32(0, 64), "block_size": 32}}, 0}),
		pack(t, []any{1.0, []any{[]any{"BlockStored", []any{make([]byte, 32)}, []byte{1, 2, 3}, iota32(0, 4), 4, nil, "CPU", "lora"}}, nil}),
		EncodeZMQPayload(3.0, []ConsolidatedEvent{
			{Kind: KindStored, BlockHash: 1, TokenIDs: []uint32{1, 2}, BlockSize: 2, LoraName: "x"},
			{Kind: KindRemoved, BlockHash: 1}, {Kind: KindCleared},
		}),
	}
}

// checkBatch asserts the decoder's promises about a batch it accepted.
func checkBatch(t *testing.T, b Batch) {
	for _, ev := range b.Events {
		switch ev.Kind {
		case KindStored:
			require.Positive(t, ev.BlockSize)
			require.Equal(t, len(ev.BlockHashes), (len(ev.TokenIDs)+ev.BlockSize-1)/ev.BlockSize)
			for i := range ev.BlockHashes {
				require.NotEmpty(t, ev.Block(i))
				require.LessOrEqual(t, len(ev.Block(i)), ev.BlockSize)
			}
		case KindRemoved, KindCleared:
		default:
			t.Fatalf("decoded an event of unknown kind %v", ev.Kind)
		}
	}
	// Whatever we accepted re-encodes (one block per STORE, as the
	// consolidator does) and decodes to the same blocks.
	var out []ConsolidatedEvent
	for _, ev := range b.Events {
		switch ev.Kind {
		case KindStored:
			for i, h := range ev.BlockHashes {
				p, hp := ev.Parent(i)
				out = append(out, ConsolidatedEvent{Kind: KindStored, BlockHash: h, ParentHash: p, HasParent: hp,
					TokenIDs: ev.Block(i), BlockSize: ev.BlockSize, LoraName: ev.LoraName})
			}
		case KindRemoved:
			for _, h := range ev.BlockHashes {
				out = append(out, ConsolidatedEvent{Kind: KindRemoved, BlockHash: h})
			}
		default:
			out = append(out, ConsolidatedEvent{Kind: KindCleared})
		}
	}
	back, err := DecodePayload(EncodeZMQPayload(b.TS, out))
	require.NoError(t, err)
	require.Empty(t, back.Skipped)
	require.Len(t, back.Events, len(out))
	for i, ev := range back.Events {
		require.Equal(t, out[i].Kind, ev.Kind)
		if ev.Kind == KindStored {
			require.Equal(t, out[i].TokenIDs, ev.TokenIDs)
			require.Equal(t, out[i].HasParent, ev.HasParent)
			require.Equal(t, out[i].LoraName, ev.LoraName)
		}
	}
}

// DecodePayload is a one-off helper for tests.
func DecodePayload(p []byte) (Batch, error) { return NewDecoder().DecodePayload(p) }

func FuzzDecodeBatch(f *testing.F) {
	for _, p := range seedPayloads(f) {
		f.Add(p)
	}
	f.Add([]byte{0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x90})
	f.Add([]byte("\x93 \x91\x85\b*8$\x03\xc6\xac000000000000000000"))
	dec := NewDecoder()
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := dec.DecodePayload(payload)
		if err != nil {
			return
		}
		checkBatch(t, b)
	})
}

func FuzzDecodeMessage(f *testing.F) {
	for i, p := range seedPayloads(f) {
		f.Add([]byte("kv"), seqFrame(uint64(i)), p, true)
		f.Add([]byte{}, []byte{}, p, false)
	}
	f.Fuzz(func(t *testing.T, topic, seq, payload []byte, three bool) {
		frames := [][]byte{topic, payload}
		if three {
			frames = [][]byte{topic, seq, payload}
		}
		b, err := DecodeMessage(frames)
		if err != nil {
			return
		}
		require.Equal(t, three && len(seq) == 8, b.HasSeq)
		checkBatch(t, b)
	})
}

func FuzzRouterEventJSON(f *testing.F) {
	for _, ev := range []ConsolidatedEvent{
		{Kind: KindStored, BlockHash: 1, ParentHash: 2, HasParent: true, TokensHash: 3},
		{Kind: KindRemoved, BlockHash: 1}, {Kind: KindCleared},
	} {
		b, err := json.Marshal(NewRouterEvent(1, 2, &ev))
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var re RouterEvent
		if json.Unmarshal(in, &re) != nil {
			return
		}
		d := re.Event.Data
		set := 0
		for _, ok := range []bool{d.Stored != nil, d.Removed != nil, d.Cleared} {
			if ok {
				set++
			}
		}
		if set == 0 {
			return // "data" absent: nothing to re-encode
		}
		require.Equal(t, 1, set)
		out, err := json.Marshal(re)
		require.NoError(t, err)
		var again RouterEvent
		require.NoError(t, json.Unmarshal(out, &again))
	})
}
