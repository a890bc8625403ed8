package leader

import (
	"slices"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/plan"
)

// loadState is where a slot's onboarding is.
type loadState uint8

const (
	loadNone    loadState = iota // nothing staged
	loadStaged                   // matched blocks pinned, waiting for UpdateStateAfterAlloc
	loadPlanned                  // copies decided, waiting for the next Step to emit them
	loadEmitted                  // handed to workers; sources pinned until LoadsFinished
)

// source is one matched G2/G3 block staged (or loading) for a request.
type source struct {
	tier plan.Tier
	idx  int
	hash uint64
	g1   int64 // destination G1 block, once planned
}

// slot is the leader's state for one request.
type slot struct {
	id   string
	salt uint64

	// tokens are all tokens known for the request (prompt, then generated
	// ones as the engine reports them).
	tokens []uint32
	// hashes[i] is the sequence hash of full block i; extended lazily, so it
	// may be shorter than len(tokens)/bs.
	hashes []uint64
	// g1 are the engine's block ids for the request, in order.
	g1 []int64

	seen     bool // appeared in a Step (its block list and tokens are the engine's)
	priority int

	// Offload progress: blocks [0, offloaded) were saved (or skipped as
	// already present); stopped is set by the priority filter, after which
	// the request offloads nothing more (keeps the offloaded set a prefix).
	offloaded int
	stopped   bool

	// Onboarding.
	load        loadState
	staged      []source // pinned matched blocks (loadStaged, loadPlanned)
	computedAt  int      // num_computed_tokens (the G1 hit) when staged
	plannedLoad plan.Load

	// Hit statistics of the last GetNumNewMatchedTokens (blocks).
	hits    requestHits
	matched bool // GetNumNewMatchedTokens ran: hits count for the window
}

// inflightLoad is an emitted load whose sources are still pinned.
type inflightLoad struct {
	reqID   string
	sources []source
	done    []bool // source i unpinned already (its G1 block failed)
}

// loadRef says where the last load into a G1 block came from.
type loadRef struct {
	reqID string
	k     int // index into the request's sources
	src   source
}

// setTokens makes toks the slot's token list. Hashes of the full blocks of a
// common prefix with the previous list are kept (repeated
// GetNumNewMatchedTokens calls and the first Step resend the same prompt).
// A shorter list that is a prefix of what the slot knows is ignored: the slot
// already knows more (for example generated tokens).
func (s *slot) setTokens(toks []uint32, bs int) {
	n := min(len(toks), len(s.tokens))
	same := slices.Equal(toks[:n], s.tokens[:n])
	if same && len(toks) <= len(s.tokens) {
		return
	}
	keep := 0
	if same {
		keep = min(len(s.hashes), n/bs)
	}
	s.hashes = s.hashes[:keep]
	// No sub-slice of tokens outlives a call (pools copy what they keep), so
	// the buffer is reused in place.
	s.tokens = append(s.tokens[:0], toks...)
}

// appendTokens adds generated tokens.
func (s *slot) appendTokens(toks []uint32) { s.tokens = append(s.tokens, toks...) }

// setSalt changes the salt hash; all hashes depend on it.
func (s *slot) setSalt(salt uint64) {
	if salt != s.salt {
		s.salt = salt
		s.hashes = s.hashes[:0]
	}
}

// ensureHashes extends hashes to the first n full blocks (n ≤ len(tokens)/bs).
// Each new block costs one block hash and one chain hash: O(new blocks).
func (s *slot) ensureHashes(n, bs int) {
	if n <= len(s.hashes) {
		// Already known, e.g. matching hashed the whole prompt before a
		// chunked prefill offloads its first chunk.
		return
	}
	s.hashes = slices.Grow(s.hashes, n-len(s.hashes))
	for i := len(s.hashes); i < n; i++ {
		h := hashing.BlockHash(s.tokens[i*bs:(i+1)*bs], s.salt)
		if i > 0 {
			h = hashing.ChainHash(s.hashes[i-1], h, s.salt)
		}
		s.hashes = append(s.hashes, h)
	}
}

// mergeBlockIDs appends the engine's new G1 block ids. Engines may resend ids
// the slot already has (TensorRT-LLM resends whole lists; vLLM's first
// scheduling lists every block): an incoming list whose head overlaps the
// tail of the known list contributes only what follows the overlap. Block ids
// are unique within a request, so the overlap is found from incoming[0].
// Cost: O(len(incoming)).
func (s *slot) mergeBlockIDs(incoming []int64) {
	if len(incoming) == 0 {
		return
	}
	first := incoming[0]
	for p := max(0, len(s.g1)-len(incoming)); p < len(s.g1); p++ {
		if s.g1[p] != first {
			continue
		}
		tail := s.g1[p:]
		if slices.Equal(tail, incoming[:len(tail)]) {
			s.g1 = append(s.g1, incoming[len(tail):]...)
			return
		}
		break
	}
	s.g1 = append(s.g1, incoming...)
}

// recycle clears the slot for reuse by another request, keeping its buffers
// (a 32K-token prompt's buffers are ~200 KB; reusing them keeps matching
// free of large allocations).
func (s *slot) recycle() {
	*s = slot{tokens: s.tokens[:0], hashes: s.hashes[:0], g1: s.g1[:0], staged: s.staged[:0]}
}
