package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"unsafe"

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
// leader learns what every rank recovered either here, when the workers run
// in its process, or from the engine: the adapter reads each worker's
// kvbm_worker_recovered and hands them all to kvbm_leader_restore_disk
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
		return integrity.Key{}, fmt.Errorf("DYN_KVBM_DISK_PERSIST: the key of the tier's MACs (or set "+
			"DYN_KVBM_STORAGE_SECRET): %w", err)
	}
	return k, nil
}

// recoveredRank is one rank's recovered index, in the form that crosses
// processes (msgpack).
type recoveredRank struct {
	Rank       int            `msgpack:"rank"`
	NumWorkers int            `msgpack:"num_workers"`
	Tags       []byte         `msgpack:"tags"` // plan.AppendTags
	WrittenAt  []int64        `msgpack:"written_at"`
	Discarded  map[string]int `msgpack:"discarded"`
	Seconds    float64        `msgpack:"seconds"`
}

func newRecoveredRank(rank, numWorkers int, rec storage.Recovery) recoveredRank {
	tags := make([]plan.BlockTag, len(rec.Blocks))
	at := make([]int64, len(rec.Blocks))
	for k, b := range rec.Blocks {
		tags[k] = plan.BlockTag{Block: int64(b.Index), SeqHash: b.SeqHash, Parent: b.Parent, HasParent: b.HasParent,
			Priority: b.Priority, Tokens: b.Tokens}
		at[k] = b.WrittenAt
	}
	return recoveredRank{Rank: rank, NumWorkers: numWorkers, Tags: plan.AppendTags(nil, tags), WrittenAt: at,
		Discarded: rec.Discarded, Seconds: rec.Duration.Seconds()}
}

func (r recoveredRank) blocks() ([]leader.RecoveredBlock, error) {
	tags, err := plan.ParseTags(r.Tags)
	if err != nil {
		return nil, fmt.Errorf("rank %d: recovered index: %w", r.Rank, err)
	}
	if len(tags) != len(r.WrittenAt) {
		return nil, fmt.Errorf("rank %d: recovered index: %d blocks, %d write times", r.Rank, len(tags), len(r.WrittenAt))
	}
	out := make([]leader.RecoveredBlock, len(tags))
	for k, t := range tags {
		out[k] = leader.RecoveredBlock{BlockTag: t, WrittenAt: r.WrittenAt[k]}
	}
	return out, nil
}

var recoveredMu sync.Mutex
var recoveredByRank = map[int]recoveredRank{}

// offerRecovered records what rank's worker recovered, for a leader of this
// process, and returns its encoding for one of another process.
func offerRecovered(rank, numWorkers int, rec storage.Recovery) []byte {
	r := newRecoveredRank(rank, numWorkers, rec)
	recoveredMu.Lock()
	recoveredByRank[rank] = r
	recoveredMu.Unlock()
	b, err := msgpack.Marshal(r)
	if err != nil {
		return nil // plain fields only; unreachable
	}
	return b
}

// restoreInProcess restores l from the workers of this process when every
// rank's is here (TP=1 with the worker in the scheduler's process).
func restoreInProcess(l *leader.Leader, cfg *config.Config, numWorkers int, m *metrics.Metrics, log *slog.Logger) {
	if !cfg.DiskPersist || l.NumDiskBlocks() == 0 {
		return
	}
	recoveredMu.Lock()
	ranks := make([]recoveredRank, 0, numWorkers)
	for r := range numWorkers {
		rr, ok := recoveredByRank[r]
		if !ok || rr.NumWorkers != numWorkers {
			break
		}
		ranks = append(ranks, rr)
	}
	if len(ranks) == numWorkers {
		for r := range numWorkers {
			delete(recoveredByRank, r)
		}
	}
	recoveredMu.Unlock()
	if len(ranks) < numWorkers {
		log.Info("kvbm leader: persistent disk tier: the workers run in other processes; their recovered blocks " +
			"are registered when the engine passes them on")
		return
	}
	if _, err := restoreRanks(l, ranks, m, log); err != nil {
		log.Warn("kvbm leader: persistent disk tier not restored", "err", err)
	}
}

// restoreRanks registers what the ranks recovered and records the metrics.
func restoreRanks(l *leader.Leader, ranks []recoveredRank, m *metrics.Metrics, log *slog.Logger) (int, error) {
	perRank := make([][]leader.RecoveredBlock, len(ranks))
	discarded := map[string]int{}
	var seconds float64
	for i, rr := range ranks {
		if rr.Rank != i || rr.NumWorkers != len(ranks) {
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

// kvbm_worker_recovered returns this worker's recovered index (msgpack, for
// kvbm_leader_restore_disk); empty without a persistent disk tier.
//
//export kvbm_worker_recovered
func kvbm_worker_recovered(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_recovered", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	cBuffer(h.recovered, out, outLen)
	return statusOK
}

// kvbm_leader_restore_disk registers the G3 blocks every rank recovered:
// buf is a msgpack array of kvbm_worker_recovered results, rank 0 first.
// It must come before the first step; *registered is how many blocks.
//
//export kvbm_leader_restore_disk
func kvbm_leader_restore_disk(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, registered *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := errors.Join(checkIn("kvbm_leader_restore_disk", "recovered-index buffer", buf, n),
		checkOut("kvbm_leader_restore_disk", ptr(registered))); err != nil {
		return finish(withCode(statusInvalid, err), errOut)
	}
	// The input comes from the engine's own adapter (what its workers
	// returned), not from the network.
	b := goBytes(buf, n)
	var raw [][]byte
	if err := msgpack.Unmarshal(b, &raw); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_restore_disk: %v", err), errOut)
	}
	ranks := make([]recoveredRank, len(raw))
	for i, r := range raw {
		if err := msgpack.Unmarshal(r, &ranks[i]); err != nil {
			return finish(errorf(statusInvalid, "kvbm_leader_restore_disk: rank %d: %v", i, err), errOut)
		}
	}
	got, err := restoreRanks(h.l, ranks, h.m, kvbmLogger())
	if err != nil {
		return finish(errorf(statusState, "kvbm_leader_restore_disk: %v", err), errOut)
	}
	*registered = C.int64_t(got)
	return statusOK
}
