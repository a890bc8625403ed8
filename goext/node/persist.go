package node

import (
	"fmt"
	"log/slog"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
)

// Persistent disk tier hand-over (docs/persistent-g3.md): each worker
// recovers its tier file when it opens it, before the leader exists (the
// engines register KV caches before they create their scheduler). The
// leader learns what every rank recovered either from the Registry, when
// the workers run in its process, or from the engine: the adapter reads
// each worker's Recovered and hands them all to Leader.RestoreDisk
// (vLLM's connector handshake metadata carries them between processes).

// g3Key is the key that authenticates the persistent disk tier's blocks:
// from DYN_KVBM_STORAGE_SECRET(_FILE) when set, else from the per-user
// secret kvbm creates once in $XDG_CONFIG_HOME/kvbm (or ~/.config/kvbm).
// The zero Key without persistence.
func g3Key(cfg *config.Config) (integrity.Key, error) {
	if !cfg.DiskPersist {
		return integrity.Key{}, nil
	}
	k, err := integrity.LocalKey(cfg.StorageSecret, cfg.StorageSecretDir)
	if err != nil {
		// errprefix: the message names the variable, as config's errors do
		return integrity.Key{}, fmt.Errorf("DYN_KVBM_DISK_PERSIST: the key of the tier's MACs (or set "+
			"DYN_KVBM_STORAGE_SECRET): %w", err)
	}
	return k, nil
}

// RecoveredRank is one rank's recovered index, in the form that crosses
// processes (msgpack).
type RecoveredRank struct {
	Rank       int            `msgpack:"rank"`
	NumWorkers int            `msgpack:"num_workers"`
	Tags       []byte         `msgpack:"tags"` // plan.AppendTags
	WrittenAt  []int64        `msgpack:"written_at"`
	Discarded  map[string]int `msgpack:"discarded"`
	Seconds    float64        `msgpack:"seconds"`
	offer      uint64         // which offer of the Registry (offerRecovered); not sent
}

func newRecoveredRank(rank, numWorkers int, rec storage.Recovery) RecoveredRank {
	tags := make([]plan.BlockTag, len(rec.Blocks))
	at := make([]int64, len(rec.Blocks))
	for k, b := range rec.Blocks {
		tags[k] = plan.BlockTag{Block: int64(b.Index), SeqHash: b.SeqHash, Parent: b.Parent, HasParent: b.HasParent,
			Priority: b.Priority, Tokens: b.Tokens}
		at[k] = b.WrittenAt
	}
	return RecoveredRank{Rank: rank, NumWorkers: numWorkers, Tags: plan.AppendTags(nil, tags), WrittenAt: at,
		Discarded: rec.Discarded, Seconds: rec.Duration.Seconds()}
}

func (r RecoveredRank) blocks() ([]leader.RecoveredBlock, error) {
	tags, err := plan.ParseTags(r.Tags)
	if err != nil {
		// errprefix: wrapped by the caller's message, which names the call (kvbm_leader_restore_disk)
		return nil, fmt.Errorf("rank %d: recovered index: %w", r.Rank, err)
	}
	if len(tags) != len(r.WrittenAt) {
		// errprefix: wrapped by the caller's message, which names the call
		return nil, fmt.Errorf("rank %d: recovered index: %d blocks, %d write times", r.Rank, len(tags), len(r.WrittenAt))
	}
	out := make([]leader.RecoveredBlock, len(tags))
	for k, t := range tags {
		out[k] = leader.RecoveredBlock{BlockTag: t, WrittenAt: r.WrittenAt[k]}
	}
	return out, nil
}

// offerRecovered records what rank's worker recovered, for a leader of this
// process, and returns its encoding for one of another process, and the
// call that withdraws the offer when that worker closes: a leader started
// later in the process (a second engine, or a scheduler created before its
// workers) must never register the index of a worker that is gone — its
// blocks would be another file's, and the restore it spent would refuse the
// index its own workers hand over.
func (r *Registry) offerRecovered(rank, numWorkers int, rec storage.Recovery) ([]byte, func()) {
	rr := newRecoveredRank(rank, numWorkers, rec)
	r.recMu.Lock()
	r.recSeq++
	rr.offer = r.recSeq
	r.recovered[rank] = rr
	r.recMu.Unlock()
	withdraw := func() {
		r.recMu.Lock()
		defer r.recMu.Unlock()
		if cur, ok := r.recovered[rank]; ok && cur.offer == rr.offer {
			delete(r.recovered, rank)
		}
	}
	b, err := msgpack.Marshal(rr)
	if err != nil {
		return nil, withdraw // plain fields only; unreachable
	}
	return b, withdraw
}

// takeRecovered returns every rank's recovered index when all numWorkers
// ranks of this process offered theirs (and forgets them), else nil.
func (r *Registry) takeRecovered(numWorkers int) []RecoveredRank {
	r.recMu.Lock()
	defer r.recMu.Unlock()
	ranks := make([]RecoveredRank, 0, numWorkers)
	for k := range numWorkers {
		rr, ok := r.recovered[k]
		if !ok || rr.NumWorkers != numWorkers {
			return nil
		}
		ranks = append(ranks, rr)
	}
	for k := range numWorkers {
		delete(r.recovered, k)
	}
	return ranks
}

// restoreInProcess restores l from the workers of this process when every
// rank's is here (TP=1 with the worker in the scheduler's process).
func (r *Registry) restoreInProcess(l *leader.Leader, cfg *config.Config, numWorkers int, m *metrics.Metrics, log *slog.Logger) {
	if !cfg.DiskPersist || l.NumDiskBlocks() == 0 {
		return
	}
	ranks := r.takeRecovered(numWorkers)
	if ranks == nil {
		log.Info("kvbm leader: persistent disk tier: the workers run in other processes; their recovered blocks " +
			"are registered when the engine passes them on")
		return
	}
	if _, err := restoreRanks(l, ranks, m); err != nil {
		log.Warn("kvbm leader: persistent disk tier not restored", "err", err)
	}
}

// restoreRanks registers what the ranks recovered and records the metrics.
func restoreRanks(l *leader.Leader, ranks []RecoveredRank, m *metrics.Metrics) (int, error) {
	perRank := make([][]leader.RecoveredBlock, len(ranks))
	discarded := map[string]int{}
	var seconds float64
	for i, rr := range ranks {
		if rr.Rank != i || rr.NumWorkers != len(ranks) {
			// errprefix: wrapped by the caller's message, which names the call
			return 0, fmt.Errorf("recovered index %d is rank %d of %d; want rank %d of %d", i, rr.Rank, rr.NumWorkers, i, len(ranks))
		}
		b, err := rr.blocks()
		if err != nil {
			return 0, err
		}
		perRank[i] = b
		for k, v := range rr.Discarded {
			discarded[k] += v
		}
		seconds = max(seconds, rr.Seconds)
	}
	st, err := l.RestoreDisk(perRank)
	if err != nil {
		return 0, err
	}
	for k, v := range st.Skipped {
		discarded[k] += v
	}
	m.RecordG3Recovery(st.Registered, discarded, seconds)
	return st.Registered, nil
}
