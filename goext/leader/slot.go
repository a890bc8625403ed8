package leader

import (
	"math"
	"slices"
	"time"

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

// noPriority marks a block the engine gave no priority: the offload filter
// lets it through and its copies are registered at priority 0.
const noPriority = math.MinInt

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
	// g1 are the engine's block ids for the request, in order; prio[i] is
	// the priority of block i (noPriority when the engine gave none).
	g1   []int64
	prio []int

	seen bool // appeared in a Step (its block list and tokens are the engine's)

	// KV cache groups (Options.Groups): each group's block ids, and the
	// position of each primary block (groups.go).
	groups [][]int64
	gpos   map[int64]int

	// Offload progress: blocks [0, offloaded) were saved (or skipped as
	// already present); stopped is set by the priority filter, after which
	// the request offloads nothing more (keeps the offloaded set a prefix).
	offloaded int
	stopped   bool

	// Onboarding.
	load        loadState
	staged      []source  // pinned matched blocks (loadStaged, loadPlanned)
	computedAt  int       // num_computed_tokens (the G1 hit) when staged
	decidedAt   time.Time // when the load policy chose the staged blocks
	plannedLoad plan.Load

	// Hit statistics of the last GetNumNewMatchedTokens (blocks).
	hits    requestHits
	matched bool // GetNumNewMatchedTokens ran: hits count for the window

	// Last call about the request, and its place in the leader's idle list
	// (idle.go).
	touched      time.Time
	older, newer *slot
	linked       bool
}

// inflightLoad is an emitted load whose sources are still pinned.
type inflightLoad struct {
	reqID   string
	at      time.Time // first emitted (the load-cost model times it, policy.go)
	decided time.Time // the load decision (GetNumNewMatchedTokens), for the end-to-end timing
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

// mergeBlockIDs appends the engine's new G1 block ids and their priorities
// (prios[i] is incoming[i]'s; blocks past the end of prios have none).
// Engines may resend ids the slot already has (TensorRT-LLM resends whole
// lists; vLLM's first scheduling lists every block): an incoming list whose
// head overlaps the tail of the known list contributes only what follows the
// overlap. Cost: O(len(incoming)).
func (s *slot) mergeBlockIDs(incoming []int64, prios []int) {
	for i := s.overlap(incoming); i < len(incoming); i++ {
		p := noPriority
		if i < len(prios) {
			p = prios[i]
		}
		s.g1 = append(s.g1, incoming[i])
		s.prio = append(s.prio, p)
	}
}

// overlap is how many leading ids of incoming the slot's block list already
// ends with. Block ids are unique within a request, so the overlap is found
// from incoming[0].
func (s *slot) overlap(incoming []int64) int {
	if len(incoming) == 0 {
		return 0
	}
	first := incoming[0]
	for p := max(0, len(s.g1)-len(incoming)); p < len(s.g1); p++ {
		if s.g1[p] != first {
			continue
		}
		tail := s.g1[p:]
		if slices.Equal(tail, incoming[:len(tail)]) {
			return len(tail)
		}
		break
	}
	return 0
}

// resetBlocks forgets the block list (a resumed request gets a new one).
func (s *slot) resetBlocks() {
	s.g1 = s.g1[:0]
	s.prio = s.prio[:0]
}

// recycle clears the slot for reuse by another request, keeping its buffers
// (a 32K-token prompt's buffers are ~200 KB; reusing them keeps matching
// free of large allocations).
func (s *slot) recycle() {
	*s = slot{tokens: s.tokens[:0], hashes: s.hashes[:0], g1: s.g1[:0], prio: s.prio[:0], staged: s.staged[:0]}
}
