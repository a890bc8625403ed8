package events

import (
	"bytes"
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5"
)

// ConsolidatedEvent is one event the consolidator publishes (design §7.2/7.3):
// a STORE of one logical block, the REMOVE of one, or CLEAR.
type ConsolidatedEvent struct {
	Kind Kind
	// BlockHash is the block's first hash: the external hash under which
	// the router first learned of it (STORE, REMOVE).
	BlockHash uint64
	// ParentHash is the parent's first hash (STORE; HasParent false at a
	// sequence start or when the parent is not tracked).
	ParentHash uint64
	HasParent  bool
	TokenIDs   []uint32 // STORE: exactly this block's tokens
	BlockSize  int
	LoraName   string
	// TokensHash is the router local hash of TokenIDs with LoraName (design
	// §3), RouterEvent.tokens_hash. The tracker computes it anyway for its
	// dedup key, so publishers need not hash again.
	TokensHash uint64
}

// ZMQFrames returns the consolidated output message for one batch:
// ["" (topic), seq u64 big-endian, payload].
func ZMQFrames(seq uint64, payload []byte) [][]byte {
	seqFrame := make([]byte, 8)
	binary.BigEndian.PutUint64(seqFrame, seq)
	return [][]byte{{}, seqFrame, payload}
}

// EncodeZMQPayload encodes a consolidated batch the way vLLM encodes its own
// (design §7.3): msgpack [ts, events, 0] with events as tagged arrays:
//
//	["BlockStored", [hash], parent|nil, [token ids], block_size, nil (lora_id), nil (medium), lora_name|nil]
//	["BlockRemoved", [hash], nil (medium)]
//	["AllBlocksCleared"]
//
// Every position up to lora_name is written so that positional readers that
// expect lora_id at index 5 (Dynamo's RawKvEvent, vLLM's own msgspec
// classes, whose medium field has no default) decode it. The reference
// omits medium from BlockRemoved; readers ignore trailing fields, so the
// extra nil costs nothing and keeps vLLM's decoder happy.
//
// The returned slice is freshly allocated: the ZMQ socket keeps it queued
// after the call returns.
func EncodeZMQPayload(ts float64, evs []ConsolidatedEvent) []byte {
	var buf bytes.Buffer
	buf.Grow(16 + 48*len(evs))
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	// Writes to a bytes.Buffer cannot fail, so the encoder's errors are
	// ignored below.
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(ts)
	_ = enc.EncodeArrayLen(len(evs))
	for i := range evs {
		ev := &evs[i]
		switch ev.Kind {
		case KindStored:
			_ = enc.EncodeArrayLen(8)
			_ = enc.EncodeString("BlockStored")
			_ = enc.EncodeArrayLen(1)
			_ = enc.EncodeUint(ev.BlockHash)
			if ev.HasParent {
				_ = enc.EncodeUint(ev.ParentHash)
			} else {
				_ = enc.EncodeNil()
			}
			_ = enc.EncodeArrayLen(len(ev.TokenIDs))
			for _, t := range ev.TokenIDs {
				_ = enc.EncodeUint(uint64(t))
			}
			_ = enc.EncodeInt(int64(ev.BlockSize))
			_ = enc.EncodeNil() // lora_id (deprecated)
			_ = enc.EncodeNil() // medium
			if ev.LoraName != "" {
				_ = enc.EncodeString(ev.LoraName)
			} else {
				_ = enc.EncodeNil()
			}
		case KindRemoved:
			_ = enc.EncodeArrayLen(3)
			_ = enc.EncodeString("BlockRemoved")
			_ = enc.EncodeArrayLen(1)
			_ = enc.EncodeUint(ev.BlockHash)
			_ = enc.EncodeNil() // medium
		default:
			_ = enc.EncodeArrayLen(1)
			_ = enc.EncodeString("AllBlocksCleared")
		}
	}
	_ = enc.EncodeInt(0) // data_parallel_rank: the consolidated view is rank 0
	return buf.Bytes()
}
