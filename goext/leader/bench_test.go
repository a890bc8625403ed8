package leader

import (
	"log/slog"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/hashing"
)

// BenchmarkMatch32K is the match-latency target (≤ 200 µs): a
// 32K-token prompt in 16-token blocks (2,048 sequence hashes) against 100K
// registered G2 blocks, the prompt's blocks among them.
//
//   - full: GetNumNewMatchedTokens for a new request (copy tokens, hash,
//     match G2, pin 2,047 blocks) plus RequestFinished (unpin).
//   - repeat: the same request asked again (hashes cached, re-staged).
//   - hash: hashing.SequenceHashes alone.
//   - match: pool.Match of the 2,048 hashes alone.
func BenchmarkMatch32K(b *testing.B) {
	const (
		blockSize  = 16
		promptLen  = 32 * 1024
		registered = 100_000
	)
	l, err := New(Options{
		Config:    &config.Config{CPUCacheOverrideBlocks: registered, CacheStatsMaxRequests: 1000},
		BlockSize: blockSize, BytesPerBlock: 1, NumWorkers: 1,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(3, 4))
	prompt := make([]uint32, promptLen)
	for i := range prompt {
		prompt[i] = r.Uint32N(150_000)
	}
	hashes := hashing.SequenceHashes(prompt, blockSize, hashing.DefaultSaltHash, nil)
	for i := range registered {
		h := r.Uint64()
		if i < len(hashes) {
			h = hashes[i]
		}
		idx := l.host.Allocate(1, nil)[0]
		idx, _ = l.host.Register(idx, h, 0, false, nil, 0)
		l.host.Release(idx)
	}

	b.Run("full", func(b *testing.B) {
		i := 0
		for b.Loop() {
			id := strconv.Itoa(i)
			i++
			n, _ := l.GetNumNewMatchedTokens(id, prompt, 0, 0)
			if n != promptLen-blockSize {
				b.Fatalf("matched %d tokens, want %d", n, promptLen-blockSize)
			}
			l.RequestFinished(id)
		}
	})
	b.Run("repeat", func(b *testing.B) {
		for b.Loop() {
			if n, _ := l.GetNumNewMatchedTokens("same", prompt, 0, 0); n != promptLen-blockSize {
				b.Fatalf("matched %d", n)
			}
		}
		l.RequestFinished("same")
	})
	b.Run("hash", func(b *testing.B) {
		dst := make([]uint64, 0, len(hashes))
		for b.Loop() {
			dst = hashing.SequenceHashes(prompt, blockSize, hashing.DefaultSaltHash, dst[:0])
		}
	})
	b.Run("match", func(b *testing.B) {
		dst := make([]int, 0, len(hashes))
		for b.Loop() {
			if dst = l.host.Match(hashes, dst[:0]); len(dst) != len(hashes) {
				b.Fatalf("matched %d", len(dst))
			}
		}
	})
}

// BenchmarkStepPrefill2K plans the saves of a 2,048-block prefill into a full
// 100K-block G2 (every save evicts): the per-step planning cost.
func BenchmarkStepPrefill2K(b *testing.B) {
	const (
		blockSize = 16
		nBlocks   = 2048
		capacity  = 100_000
	)
	l, err := New(Options{
		Config:    &config.Config{CPUCacheOverrideBlocks: capacity, CacheStatsMaxRequests: 1000},
		BlockSize: blockSize, BytesPerBlock: 1, NumWorkers: 1,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(5, 6))
	for range capacity {
		idx := l.host.Allocate(1, nil)[0]
		idx, _ = l.host.Register(idx, r.Uint64(), 0, false, nil, 0)
		l.host.Release(idx)
	}
	g1 := make([]int64, nBlocks)
	for i := range g1 {
		g1[i] = int64(i)
	}
	prompt := make([]uint32, nBlocks*blockSize)
	i := 0
	for b.Loop() {
		for k := range prompt {
			prompt[k] = r.Uint32()
		}
		id := strconv.Itoa(i)
		i++
		if _, err := l.Step([]RequestUpdate{{ReqID: id, NewTokens: prompt, NewBlockIDs: g1, NumScheduledTokens: len(prompt)}}); err != nil {
			b.Fatal(err)
		}
		l.RequestFinished(id)
	}
}
