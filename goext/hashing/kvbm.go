package hashing

import "github.com/zeebo/xxh3"

// BlockHash returns the KVBM content hash of one block: XXH3 of the tokens'
// little-endian u32 bytes, seeded with the request's salt hash.
func BlockHash(tokens []uint32, salt uint64) uint64 {
	var scratch scratchBuf
	return xxh3.HashSeed(tokenBytes(tokens, &scratch), salt)
}

// ChainHash returns the sequence hash of a block whose parent has sequence
// hash prev and whose own content hash is block: XXH3 of
// LE_u64(prev) ‖ LE_u64(block), seeded with the salt hash. The first block of
// a sequence has no parent; its sequence hash is its block hash.
func ChainHash(prev, block, salt uint64) uint64 {
	return newChainKey(salt).hash16(prev, block)
}

// SequenceHashes appends to dst the KVBM sequence hash of every full block of
// tokens (len(tokens)/blockSize of them) and returns the extended slice. The
// trailing partial block, if any, is ignored: it has no hash until it fills.
//
// With cap(dst)-len(dst) ≥ len(tokens)/blockSize this allocates nothing. It
// panics if blockSize < 1, which is a programming error (block sizes are
// validated when the engine registers its layout).
func SequenceHashes(tokens []uint32, blockSize int, salt uint64, dst []uint64) []uint64 {
	if blockSize < 1 {
		panic("hashing: SequenceHashes: block size must be positive")
	}
	n := len(tokens) / blockSize
	if n == 0 {
		return dst
	}
	dst = growLen(dst, n)
	out := dst[len(dst)-n:]

	// Per block: one XXH3 of the tokens (tokenBytes is a free
	// reinterpretation on little-endian machines) and one 16-byte XXH3 for
	// the chain, both inlined for the common block sizes (see xxh3short.go).
	// Block hashes are independent of each other, so the CPU overlaps them
	// with the serial chain.
	chain := newChainKey(salt)
	var scratch scratchBuf
	if bytes := 4 * blockSize; bytes >= shortHashMin && bytes <= shortHashMax {
		short := newShortKey(salt)
		sequenceHashesShort(tokens, blockSize, &short, chain, out)
		return dst
	}
	prev := xxh3.HashSeed(tokenBytes(tokens[:blockSize], &scratch), salt)
	out[0] = prev
	for i := 1; i < n; i++ {
		prev = chain.hash16(prev, xxh3.HashSeed(tokenBytes(tokens[i*blockSize:(i+1)*blockSize], &scratch), salt))
		out[i] = prev
	}
	return dst
}

// growLen extends s by n elements, reallocating only if capacity is short.
func growLen(s []uint64, n int) []uint64 {
	if cap(s)-len(s) < n {
		grown := make([]uint64, len(s), len(s)+n)
		copy(grown, s)
		s = grown
	}
	return s[:len(s)+n]
}

// stateSeed seeds StateHash: the bytes "kvbm state" read as a little-endian
// u64 prefix, so that no sequence hash's own chain step produces it.
const stateSeed = 0x6174_7320_6d62_766b // "kvbm sta"

// StateHash returns the key of a block stored with the recurrent state of a
// hybrid model's state layers at its end (docs/design.md §11): a position
// whose sequence hash is seq, copied in the step that ended exactly at its
// last token, so that its state layers hold the state a hit of its length
// resumes from. Blocks under seq itself hold the position's attention
// layers only as far as a load is concerned.
func StateHash(seq uint64) uint64 {
	return newChainKey(stateSeed).hash16(seq, stateSeed)
}
