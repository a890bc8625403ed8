package leader

import (
	"context"
	"log/slog"
	"testing"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/pool"
)

// BenchmarkPurgeScan: what a salt purge holds the leader's lock for (the
// scheduler waits on it), against a G2 tier of 100K registered 16-token
// blocks of other salts (nothing to remove, so every iteration scans the
// same tier), next to the baseline of the same run: a scan that only reads
// each block (pool.Info), no rehash.
//
//	go test -run '^$' -bench PurgeScan ./goext/leader
func BenchmarkPurgeScan(b *testing.B) {
	const blockSize, registered = 16, 100_000
	l, err := New(Options{
		Config:    &config.Config{CPUCacheOverrideBlocks: registered, CacheStatsMaxRequests: 1000},
		BlockSize: blockSize, BytesPerBlock: 1, NumWorkers: 1, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	other := hashing.SaltHash("other", true, "", false)
	tokens := make([]uint32, registered*blockSize)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	hs := hashing.SequenceHashes(tokens, blockSize, other, nil)
	for i, h := range hs {
		idx := l.host.Allocate(1, nil)[0]
		var parent uint64
		if i > 0 {
			parent = hs[i-1]
		}
		idx, _ = l.host.Register(idx, h, parent, i > 0, tokens[i*blockSize:(i+1)*blockSize], 0)
		l.host.Release(idx)
	}
	b.Run("baseline-read-only-scan", func(b *testing.B) {
		n := 0
		for b.Loop() {
			for _, idx := range l.host.Registered(nil) {
				if l.host.Info(idx).State == pool.Registered {
					n++
				}
			}
		}
		_ = n
	})
	b.Run("purge-salt", func(b *testing.B) {
		req := PurgeRequest{Salts: []uint64{hashing.SaltHash("tenant", true, "", false)}}
		for b.Loop() {
			if res, err := l.Purge(context.Background(), req); err != nil || res.HostBlocks != 0 {
				b.Fatal(res, err)
			}
		}
	})
}
