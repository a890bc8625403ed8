package hashing

import (
	"encoding/binary"
	"math/bits"
)

// Specialised XXH3-64 for the two input shapes on the sequence-hash hot path.
//
// A 32K-token prompt at vLLM's 16-token blocks is 2048 block hashes of 64
// bytes plus 2048 chain hashes of 16 bytes. Through xxh3.HashSeed each of
// those is a non-inlined call with a length dispatch and per-call seed mixing,
// and Go's ABI spills the running chain value around every call; measured, the
// chained loop ran at ~55-65% of hashing the same bytes unchained. XXH3's
// 9..16- and 17..128-byte paths are a few multiply-folds each, so we inline
// them with the seed mixing hoisted out (once per salt, not once per block).
// Longer blocks (> 32 tokens) still go through xxh3.HashSeed, where the
// per-call overhead is amortised over the bytes.
//
// The arithmetic is XXH3 v0.8's, transcribed from its specification; the
// constants are its default secret read as little-endian u64 at the offsets
// in their names. TestShortKeyMatchesXXH3 and TestChainKeyMatchesXXH3 compare
// both paths with xxh3.HashSeed over every length and random seeds.
const (
	secret000 = 0xbe4ba423396cfeb8
	secret008 = 0x1cad21f72c81017c
	secret016 = 0xdb979083e96dd4de
	secret024 = 0x1f67b3b7a4a44072
	secret032 = 0x78e5c0cc4ee679cb
	secret040 = 0x2172ffcc7dd05a82
	secret048 = 0x8e2443f7744608b8
	secret056 = 0x4c263a81e69035e0
	secret064 = 0xcb00c391bb52283c
	secret072 = 0xa32e531b8b65d088
	secret080 = 0x4ef90da297486471
	secret088 = 0xd8acdea946ef1938
	secret096 = 0x3f349ce33f76faa8
	secret104 = 0x1d4f0bc7c7bbdcf9
	secret112 = 0x3159b4cd4be0518a
	secret120 = 0x647378d9c97e9fc8

	prime64x1    = 11400714785074694791
	avalancheMul = 0x165667919e3779f9
)

func mulFold64(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

func avalanche(h uint64) uint64 {
	h ^= h >> 37
	h *= avalancheMul
	return h ^ h>>32
}

// chainKey is the seed-dependent part of a 16-byte XXH3.
type chainKey struct{ lo, hi uint64 }

func newChainKey(seed uint64) chainKey {
	return chainKey{lo: (secret024 ^ secret032) + seed, hi: (secret040 ^ secret048) - seed}
}

// hash16 returns XXH3-64(LE_u64(a) ‖ LE_u64(b), seed) for the key's seed.
func (k chainKey) hash16(a, b uint64) uint64 {
	lo := a ^ k.lo
	hi := b ^ k.hi
	return avalanche(16 + bits.ReverseBytes64(lo) + hi + mulFold64(lo, hi))
}

// routerChainKey is the chain key of the router's fixed seed.
var routerChainKey = newChainKey(RouterSeed)

// shortKey is the seed-dependent part of XXH3 for 17..128-byte inputs: the
// default secret's first 128 bytes with the seed added to even and
// subtracted from odd words.
type shortKey [16]uint64

func newShortKey(seed uint64) shortKey {
	s := [16]uint64{
		secret000, secret008, secret016, secret024, secret032, secret040, secret048, secret056,
		secret064, secret072, secret080, secret088, secret096, secret104, secret112, secret120,
	}
	for i := range s {
		if i%2 == 0 {
			s[i] += seed
		} else {
			s[i] -= seed
		}
	}
	return s
}

// shortHashMin and shortHashMax bound the input lengths hash accepts.
const (
	shortHashMin = 17
	shortHashMax = 128
)

// hash returns XXH3-64(p, seed) for 17 ≤ len(p) ≤ 128.
func (k *shortKey) hash(p []byte) uint64 {
	l := len(p)
	_ = p[l-1]
	_ = p[15] // l ≥ 17: lets the compiler drop the bounds checks below
	r := func(i int) uint64 { return binary.LittleEndian.Uint64(p[i:]) }
	acc := uint64(l) * prime64x1
	if l > 32 {
		if l > 64 {
			if l > 96 {
				acc += mulFold64(r(48)^k[12], r(56)^k[13])
				acc += mulFold64(r(l-64)^k[14], r(l-56)^k[15])
			}
			acc += mulFold64(r(32)^k[8], r(40)^k[9])
			acc += mulFold64(r(l-48)^k[10], r(l-40)^k[11])
		}
		acc += mulFold64(r(16)^k[4], r(24)^k[5])
		acc += mulFold64(r(l-32)^k[6], r(l-24)^k[7])
	}
	acc += mulFold64(r(0)^k[0], r(8)^k[1])
	acc += mulFold64(r(l-16)^k[2], r(l-8)^k[3])
	return avalanche(acc)
}

// sequenceHashesShort is SequenceHashes for blocks of 17..128 bytes, with
// shortKey.hash and chainKey.hash16 written out in the loop body. It must
// not call anything: Go's register ABI has no callee-saved registers, so a
// call would spill the running chain value to the stack and put a
// store-to-load round trip on the serial chain of every block. With the body
// call-free the CPU overlaps the independent block hashes with the chain.
// TestSequenceHashesAllBlockSizes pins it to BlockHash+ChainHash.
func sequenceHashesShort(tokens []uint32, blockSize int, k *shortKey, chain chainKey, out []uint64) {
	var scratch scratchBuf
	l := 4 * blockSize
	var prev uint64
	for i := range out {
		p := tokenBytes(tokens[i*blockSize:(i+1)*blockSize], &scratch)
		p = p[:l:l]
		_ = p[15]
		acc := uint64(l) * prime64x1
		if l > 32 {
			if l > 64 {
				if l > 96 {
					acc += mulFold64(binary.LittleEndian.Uint64(p[48:])^k[12], binary.LittleEndian.Uint64(p[56:])^k[13])
					acc += mulFold64(binary.LittleEndian.Uint64(p[l-64:])^k[14], binary.LittleEndian.Uint64(p[l-56:])^k[15])
				}
				acc += mulFold64(binary.LittleEndian.Uint64(p[32:])^k[8], binary.LittleEndian.Uint64(p[40:])^k[9])
				acc += mulFold64(binary.LittleEndian.Uint64(p[l-48:])^k[10], binary.LittleEndian.Uint64(p[l-40:])^k[11])
			}
			acc += mulFold64(binary.LittleEndian.Uint64(p[16:])^k[4], binary.LittleEndian.Uint64(p[24:])^k[5])
			acc += mulFold64(binary.LittleEndian.Uint64(p[l-32:])^k[6], binary.LittleEndian.Uint64(p[l-24:])^k[7])
		}
		acc += mulFold64(binary.LittleEndian.Uint64(p[0:])^k[0], binary.LittleEndian.Uint64(p[8:])^k[1])
		acc += mulFold64(binary.LittleEndian.Uint64(p[l-16:])^k[2], binary.LittleEndian.Uint64(p[l-8:])^k[3])
		h := avalanche(acc)
		if i > 0 {
			lo := prev ^ chain.lo
			hi := h ^ chain.hi
			h = avalanche(16 + bits.ReverseBytes64(lo) + hi + mulFold64(lo, hi))
		}
		out[i] = h
		prev = h
	}
}
