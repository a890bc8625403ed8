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
	// HolderEngineHost: the engine's own host memory tier (SGLang HiCache's
	// L2, KV events of medium "CPU_PINNED"), a holder of its own so that a
	// block evicted from the GPU but kept there stays announced.
	HolderEngineHost Holder = 5
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
	case HolderEngineHost:
		return "EngineHost"
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
	// ByHash: SeqHash is the engine's own external hash of the block, not
	// kvbm's sequence hash, and the event carries no tokens (kvbm's SGLang
	// HiCache storage, whose calls name pages by SGLang's page keys only).
	// The consolidator adds or drops the holder of the engine's block of
	// that hash; a store it cannot place yet waits for the engine's STORE.
	ByHash bool
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
