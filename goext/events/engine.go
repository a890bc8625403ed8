package events

import "fmt"

// Kind says what an engine or consolidated event does.
type Kind uint8

const (
	KindStored  Kind = 1 // BlockStored: blocks became cached
	KindRemoved Kind = 2 // BlockRemoved: blocks were evicted
	KindCleared Kind = 3 // AllBlocksCleared: the whole cache was reset
)

func (k Kind) String() string {
	switch k {
	case KindStored:
		return "BlockStored"
	case KindRemoved:
		return "BlockRemoved"
	case KindCleared:
		return "AllBlocksCleared"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// EngineEvent is one decoded engine KV event (design §7.1). Hashes are the
// engine's opaque external hashes as u64 (signed values bit-cast, byte
// digests reduced to their last 8 bytes big-endian).
//
// A stored event has been validated: BlockSize > 0 and TokenIDs split into
// chunks of BlockSize gives exactly len(BlockHashes) chunks (the last chunk
// may be short, as in the reference); use Block(i) to get block i's tokens.
type EngineEvent struct {
	Kind        Kind
	BlockHashes []uint64
	// ParentHash is the external hash of the block before BlockHashes[0];
	// HasParent is false at the start of a sequence.
	ParentHash uint64
	HasParent  bool
	TokenIDs   []uint32
	BlockSize  int
	LoraName   string // "" when the event names no adapter
	Medium     string // "GPU", "CPU", ...; "" when absent
	// Group is the engine's KV cache group (vLLM's hybrid KV cache
	// manager: group_idx) when HasGroup; GroupKind its attention kind as
	// vLLM names it ("full_attention", "sliding_window", ...), on stores.
	Group     int
	HasGroup  bool
	GroupKind string
}

// NumBlocks is the number of blocks the event covers.
func (e *EngineEvent) NumBlocks() int { return len(e.BlockHashes) }

// Block returns the tokens of block i of a stored event (a sub-slice of
// TokenIDs, not a copy).
func (e *EngineEvent) Block(i int) []uint32 {
	lo := i * e.BlockSize
	hi := min(lo+e.BlockSize, len(e.TokenIDs))
	return e.TokenIDs[lo:hi]
}

// Parent returns the external parent hash of block i: the event's parent
// for block 0, else the previous block of the same event.
func (e *EngineEvent) Parent(i int) (uint64, bool) {
	if i == 0 {
		return e.ParentHash, e.HasParent
	}
	return e.BlockHashes[i-1], true
}

// EventError describes one event of a batch that was skipped.
type EventError struct {
	Index  int    // position of the event in the batch
	Reason string // short, human-readable
}

func (e EventError) Error() string {
	return fmt.Sprintf("events: event %d skipped: %s", e.Index, e.Reason)
}

// Batch is one decoded engine message.
type Batch struct {
	Topic     []byte
	Seq       uint64 // the publisher's sequence number (3-frame messages)
	HasSeq    bool
	TS        float64 // publisher timestamp, seconds since the epoch
	DPRank    int
	HasDPRank bool
	Events    []EngineEvent
	// Skipped lists the events that were malformed; the rest of the batch
	// is still usable.
	Skipped []EventError
}
