package events

// Holder names who holds a copy of a block, for the consolidator's
// deduplication. The engine's G1 is one holder; kvbm's host (G2) and disk (G3)
// tiers are separate holders so that evicting one tier's copy never announces a
// removal while the other tier still has the block.
type Holder uint8

const (
	HolderEngine   Holder = 1 // vLLM or TensorRT-LLM G1
	HolderKvbmHost Holder = 2 // kvbm G2
	HolderKvbmDisk Holder = 3 // kvbm G3
	// HolderKvbmObject: kvbm G4, the blocks this leader's G4 registry
	// believes the object store holds (tier events only, never the
	// consolidator's).
	HolderKvbmObject Holder = 4
)

func (h Holder) String() string {
	switch h {
	case HolderEngine:
		return "Engine"
	case HolderKvbmHost:
		return "KvbmHost"
	case HolderKvbmDisk:
		return "KvbmDisk"
	case HolderKvbmObject:
		return "KvbmObject"
	}
	return "Unknown"
}

// BlockEvent is one registration or eviction in a kvbm tier (G2 or G3),
// published by the leader to a Sink.
type BlockEvent struct {
	Removed bool   // false: stored (registered); true: evicted
	Holder  Holder // HolderKvbmHost or HolderKvbmDisk
	// SeqHash is kvbm's salted sequence hash of the block (design §3).
	SeqHash uint64
	// Parent is the sequence hash of the previous block; HasParent is false
	// for the first block of a sequence. Unused for removals.
	Parent    uint64
	HasParent bool
	Tokens    []uint32 // the block's tokens (stores only)
	BlockSize int
	LoraName  string
}

// Sink receives kvbm's tier events. Implementations must not block for long:
// the leader calls Publish on its hot path.
type Sink interface {
	Publish(ev BlockEvent)
}

// NopSink discards every event.
type NopSink struct{}

// Publish implements Sink.
func (NopSink) Publish(BlockEvent) {}
