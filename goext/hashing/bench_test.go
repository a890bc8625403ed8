package hashing

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/zeebo/xxh3"
)

// benchPromptTokens is a long prompt, the case where hashing cost shows up in
// time-to-first-token.
const benchPromptTokens = 32 * 1024

var benchBlockSizes = []int{16, 32, 128}

func benchPrompt() []uint32 {
	tokens := make([]uint32, benchPromptTokens)
	for i := range tokens {
		tokens[i] = uint32(i*2654435761) % 151936 // spread over a Qwen-sized vocabulary
	}
	return tokens
}

func reportTokens(b *testing.B) {
	b.ReportMetric(float64(b.N)*benchPromptTokens/b.Elapsed().Seconds(), "tokens/s")
}

// BenchmarkSequenceHashes is KVBM's full per-prompt work: one seeded XXH3 per
// block plus one 16-byte chain hash. Compare with BenchmarkRawXXH3.
func BenchmarkSequenceHashes(b *testing.B) {
	tokens := benchPrompt()
	for _, bs := range benchBlockSizes {
		b.Run(fmt.Sprint(bs), func(b *testing.B) {
			dst := make([]uint64, 0, benchPromptTokens/bs)
			b.SetBytes(benchPromptTokens * 4)
			b.ReportAllocs()
			for b.Loop() {
				dst = SequenceHashes(tokens, bs, DefaultSaltHash, dst[:0])
			}
			reportTokens(b)
		})
	}
}

// BenchmarkRawXXH3 is the baseline: the same bytes, pre-encoded, hashed in
// the same block-sized pieces with plain xxh3.HashSeed and no chaining. It
// is the floor any implementation of design §3 pays.
func BenchmarkRawXXH3(b *testing.B) {
	tokens := benchPrompt()
	raw := make([]byte, 4*len(tokens))
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(raw[4*i:], t)
	}
	for _, bs := range benchBlockSizes {
		b.Run(fmt.Sprint(bs), func(b *testing.B) {
			step := 4 * bs
			var sink uint64
			b.SetBytes(benchPromptTokens * 4)
			b.ReportAllocs()
			for b.Loop() {
				for off := 0; off+step <= len(raw); off += step {
					sink ^= xxh3.HashSeed(raw[off:off+step], DefaultSaltHash)
				}
			}
			benchSink = sink
			reportTokens(b)
		})
	}
}

// BenchmarkRouterSequenceHashes covers the consolidator's path (it allocates
// its result).
func BenchmarkRouterSequenceHashes(b *testing.B) {
	tokens := benchPrompt()
	b.SetBytes(benchPromptTokens * 4)
	b.ReportAllocs()
	for b.Loop() {
		_ = RouterSequenceHashes(tokens, 32, "")
	}
	reportTokens(b)
}

var benchSink uint64
