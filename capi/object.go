package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/object"
)

// G4 stores of this process, one per fingerprint: with tensor parallelism 1
// the leader and the only worker share a process, and sharing the store
// shares its registry, so the leader knows at once what the worker uploaded.
var g4 struct {
	mu     sync.Mutex
	stores map[fingerprint.Fingerprint]*g4Ref
	rank0  fingerprint.Fingerprint // fingerprint of this process's rank 0 worker, if any
}

type g4Ref struct {
	s    *object.Store
	refs int
}

// openG4 returns the process's store for fp (creating it: client, bucket,
// upload queue); release drops the reference and closes the store with the
// last one. The store being unreachable at start is not an error: the tier
// degrades (circuit breaker) and comes back by itself.
func openG4(o *config.Object, fp fingerprint.Fingerprint, blockBytes int64, workerID uint64, log *slog.Logger) (*object.Store, func(), error) {
	g4.mu.Lock()
	defer g4.mu.Unlock()
	if r, ok := g4.stores[fp]; ok {
		r.refs++
		return r.s, func() { releaseG4(fp) }, nil
	}
	bucket := o.BucketFor(workerID)
	c, err := object.NewClient(object.ClientOptions{Host: o.Host, Secure: o.Secure, Region: o.Region,
		Bucket: bucket, AccessKey: o.AccessKey, SecretKey: o.SecretKey})
	if err != nil {
		return nil, nil, withCode(statusConfig, fmt.Errorf("%s=%q: %w", config.EnvObjectEndpoint, o.Endpoint, err))
	}
	s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp, BlockBytes: int(blockBytes),
		Registry: object.NewRegistry(o.NumBlocks), Logger: log})
	if err != nil {
		return nil, nil, withCode(statusConfig, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.EnsureBucket(ctx, o.Region); err != nil {
		log.Warn("kvbm G4: object store not reachable at start; continuing without it until it answers",
			"endpoint", o.Endpoint, "bucket", bucket, "err", err)
	}
	log.Info("kvbm G4 tier", "endpoint", o.Endpoint, "bucket", bucket, "region", o.Region,
		"fingerprint", fp.String(), "write_through", o.WriteThrough, "registry_blocks", o.NumBlocks,
		"block_bytes", blockBytes)
	if g4.stores == nil {
		g4.stores = make(map[fingerprint.Fingerprint]*g4Ref)
	}
	g4.stores[fp] = &g4Ref{s: s, refs: 1}
	return s, func() { releaseG4(fp) }, nil
}

func releaseG4(fp fingerprint.Fingerprint) {
	g4.mu.Lock()
	r, ok := g4.stores[fp]
	if ok {
		if r.refs--; r.refs == 0 {
			delete(g4.stores, fp)
		} else {
			r = nil
		}
	}
	g4.mu.Unlock()
	if r != nil {
		r.s.Close()
	}
}

// setRank0Fingerprint records the fingerprint of this process's rank 0
// worker: a leader in the same process looks G4 up under it.
func setRank0Fingerprint(fp fingerprint.Fingerprint) {
	g4.mu.Lock()
	g4.rank0 = fp
	g4.mu.Unlock()
}

func rank0Fingerprint() fingerprint.Fingerprint {
	g4.mu.Lock()
	defer g4.mu.Unlock()
	return g4.rank0
}

// leaderG4 opens the leader's view of G4 (nil when the tier is off, or
// when no rank 0 fingerprint is known: then the workers still upload, but
// this leader matches nothing in G4, and says so).
func leaderG4(o *leaderOptions, cfg *config.Config, h *leaderHandle, log *slog.Logger) (*leader.G4Options, error) {
	if !cfg.Object.Enabled {
		return nil, nil
	}
	if err := cfg.CheckObject(); err != nil {
		return nil, withCode(statusConfig, err)
	}
	var fp fingerprint.Fingerprint
	if o.Fingerprint != "" {
		var err error
		if fp, err = fingerprint.Parse(o.Fingerprint); err != nil {
			return nil, errorf(statusInvalid, "kvbm_leader_new: %v", err)
		}
	} else {
		fp = rank0Fingerprint()
	}
	if fp.IsZero() {
		log.Warn("kvbm G4: the leader does not know rank 0's block fingerprint (no worker in this process); " +
			"workers upload, but this leader matches nothing in G4")
		return nil, nil
	}
	s, closeFn, err := openG4(&cfg.Object, fp, o.BytesPerBlock, o.WorkerID, log)
	if err != nil {
		return nil, err
	}
	h.g4Close = closeFn
	return &leader.G4Options{Store: s, Async: o.G4Async, WriteThrough: cfg.Object.WriteThrough}, nil
}
