package hashing

import "github.com/zeebo/xxh3"

// RouterSeed is the fixed XXH3 seed of the KV router's hashes
// (XXH3_SEED in the reference's kv-router protocols).
const RouterSeed uint64 = 1337

// HashBytes is the router's primitive: XXH3 of b with seed 1337.
func HashBytes(b []byte) uint64 {
	return xxh3.HashSeed(b, RouterSeed)
}

// RouterLoraSeed returns the seed of router local hashes for an adapter:
// 1337 with no LoRA (empty name), else 1337 + XXH3(name, seed 0), wrapping.
// The reference treats an empty name as "no LoRA", so we do too.
func RouterLoraSeed(loraName string) uint64 {
	if loraName == "" {
		return RouterSeed
	}
	return RouterSeed + xxh3.HashString(loraName)
}

// RouterLocalHash returns the router's LocalBlockHash (tokens_hash) of one
// block: XXH3 of the tokens' little-endian u32 bytes with RouterLoraSeed.
func RouterLocalHash(tokens []uint32, loraName string) uint64 {
	var scratch scratchBuf
	return xxh3.HashSeed(tokenBytes(tokens, &scratch), RouterLoraSeed(loraName))
}

// RouterSequenceHash chains a router local hash onto its parent's sequence
// hash: XXH3(LE_u64(prev) ‖ LE_u64(local), 1337). The seed stays 1337 even
// for LoRA requests; only local hashes carry the adapter.
func RouterSequenceHash(prev, local uint64) uint64 {
	return routerChainKey.hash16(prev, local)
}

// RouterLocalHashes appends the router local hash of every full block of
// tokens to dst (partial tail ignored) and returns the extended slice.
// It panics if blockSize < 1.
func RouterLocalHashes(tokens []uint32, blockSize int, loraName string, dst []uint64) []uint64 {
	if blockSize < 1 {
		panic("hashing: RouterLocalHashes: block size must be positive")
	}
	n := len(tokens) / blockSize
	if n == 0 {
		return dst
	}
	seed := RouterLoraSeed(loraName)
	dst = growLen(dst, n)
	out := dst[len(dst)-n:]
	var scratch scratchBuf
	if bytes := 4 * blockSize; bytes >= shortHashMin && bytes <= shortHashMax {
		short := newShortKey(seed)
		for i := range n {
			out[i] = short.hash(tokenBytes(tokens[i*blockSize:(i+1)*blockSize], &scratch))
		}
		return dst
	}
	for i := range n {
		out[i] = xxh3.HashSeed(tokenBytes(tokens[i*blockSize:(i+1)*blockSize], &scratch), seed)
	}
	return dst
}

// RouterSequenceHashes returns the router sequence hash of every full block
// of tokens: seq[0] = local[0], seq[i] = RouterSequenceHash(seq[i-1], local[i]).
func RouterSequenceHashes(tokens []uint32, blockSize int, loraName string) []uint64 {
	seq := RouterLocalHashes(tokens, blockSize, loraName, nil)
	for i := 1; i < len(seq); i++ {
		seq[i] = RouterSequenceHash(seq[i-1], seq[i])
	}
	return seq
}
