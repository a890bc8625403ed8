package events

import (
	"testing"
)

// benchBatch is a vLLM-shaped batch: n BlockStored events of one 16-token
// block each, with 64-bit hashes (the common int-hash case).
func benchBatch(b *testing.B, n int, maps bool) []byte {
	evs := make([]any, n)
	for i := range evs {
		h := uint64(1)<<63 + uint64(i)*0x9e3779b97f4a7c15
		toks := iota32(1000+16*i, 16)
		if maps {
			evs[i] = map[string]any{"type": "BlockStored", "block_hashes": []any{h}, "parent_block_hash": h - 1,
				"token_ids": toks, "block_size": 16, "medium": "GPU", "extra_keys": []any{nil}, "group_idx": 0}
		} else {
			evs[i] = vllmArrayStored([]any{h}, h-1, toks, 16)
		}
	}
	return pack(b, []any{1718000000.0, evs, 0})
}

func benchDecode(b *testing.B, maps bool) {
	const n = 64
	payload := benchBatch(b, n, maps)
	frames := [][]byte{{}, seqFrame(1), payload}
	dec := NewDecoder()
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		batch, err := dec.DecodeMessage(frames)
		if err != nil || len(batch.Events) != n {
			b.Fatalf("decode: %v (%d events)", err, len(batch.Events))
		}
	}
	b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkDecodeVllmArrayBatch: decode-only rate of vLLM's array encoding
// (the baseline the end-to-end consolidator rate is compared against).
func BenchmarkDecodeVllmArrayBatch(b *testing.B) { benchDecode(b, false) }

// BenchmarkDecodeVllmMapBatch: the same events in vLLM's newer map encoding.
func BenchmarkDecodeVllmMapBatch(b *testing.B) { benchDecode(b, true) }

// BenchmarkEncodeZMQPayload: consolidated output encoding, 64 STOREs.
func BenchmarkEncodeZMQPayload(b *testing.B) {
	evs := make([]ConsolidatedEvent, 64)
	for i := range evs {
		toks := make([]uint32, 16)
		for j := range toks {
			toks[j] = uint32(1000 + 16*i + j)
		}
		evs[i] = ConsolidatedEvent{Kind: KindStored, BlockHash: uint64(1)<<63 + uint64(i), ParentHash: uint64(i),
			HasParent: true, TokenIDs: toks, BlockSize: 16}
	}
	b.ReportAllocs()
	for b.Loop() {
		_ = EncodeZMQPayload(1.0, evs)
	}
	b.ReportMetric(float64(len(evs)*b.N)/b.Elapsed().Seconds(), "events/s")
}
