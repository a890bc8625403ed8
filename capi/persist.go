package main

import (
	"log/slog"
	"sync"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
)

// Persistent disk tier hand-over (docs/persistent-g3.md): each worker
// recovers its tier file when it opens it, before the leader exists (the
// engines register KV caches before they create their scheduler). What it
// recovered waits here, per rank, for the leader of the same process, or
// arrives from other processes in the side channel's handshake.

type recoveredRank struct {
	numWorkers int
	blocks     []leader.RecoveredBlock
	discarded  map[string]int
	seconds    float64
}

var recoveredMu sync.Mutex
var recoveredByRank = map[int]recoveredRank{}

// offerRecovered records what rank's worker recovered.
func offerRecovered(rank, numWorkers int, rec storage.Recovery) {
	r := recoveredRank{numWorkers: numWorkers, discarded: rec.Discarded, seconds: rec.Duration.Seconds(),
		blocks: make([]leader.RecoveredBlock, len(rec.Blocks))}
	for k, b := range rec.Blocks {
		r.blocks[k] = leader.RecoveredBlock{
			BlockTag: plan.BlockTag{Block: int64(b.Index), SeqHash: b.SeqHash, Parent: b.Parent, HasParent: b.HasParent,
				Priority: b.Priority, Tokens: b.Tokens},
			WrittenAt: b.WrittenAt,
		}
	}
	recoveredMu.Lock()
	recoveredByRank[rank] = r
	recoveredMu.Unlock()
}

// restoreDisk hands the recovered blocks of ranks [0, numWorkers) to l, once.
// A rank whose recovery is not known (its worker runs in another process
// and told nothing) means no block can be trusted whole: nothing is restored.
func restoreDisk(l *leader.Leader, cfg *config.Config, numWorkers int, m *metrics.Metrics, log *slog.Logger) {
	if !cfg.DiskPersist || l.NumDiskBlocks() == 0 {
		return
	}
	recoveredMu.Lock()
	perRank := make([][]leader.RecoveredBlock, numWorkers)
	discarded := map[string]int{}
	var seconds float64
	missing := []int{}
	for r := range numWorkers {
		rr, ok := recoveredByRank[r]
		if !ok || rr.numWorkers != numWorkers {
			missing = append(missing, r)
			continue
		}
		perRank[r] = rr.blocks
		for k, v := range rr.discarded {
			discarded[k] += v
		}
		seconds = max(seconds, rr.seconds)
	}
	if len(missing) == 0 {
		for r := range numWorkers {
			delete(recoveredByRank, r)
		}
	}
	recoveredMu.Unlock()
	if len(missing) > 0 {
		log.Warn("kvbm leader: persistent disk tier: the recovered blocks of some ranks are unknown to this process; "+
			"starting with an empty disk tier index", "ranks", missing)
		m.RecordG3Recovery(0, discarded, seconds)
		return
	}
	st, err := l.RestoreDisk(perRank)
	if err != nil {
		log.Warn("kvbm leader: persistent disk tier not restored", "err", err)
		return
	}
	for k, v := range st.Skipped {
		discarded[k] += v
	}
	m.RecordG3Recovery(st.Registered, discarded, seconds)
}
