package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"

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

// openG4 returns the process's store for fp (creating it: client, upload
// queue); release drops the reference and closes the store with the last
// one. It never waits on the network (the engine's scheduler thread calls
// it, under g4.mu): the bucket is checked, and created when missing, in the
// background; while that check fails the leader leaves G4 off
// (goext/object/bucketcheck.go).
func openG4(cfg *config.Config, fp fingerprint.Fingerprint, blockBytes int64, workerID uint64, log *slog.Logger) (*object.Store, func(), error) {
	o := &cfg.Object
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
	key := c.ObjectKey(cfg.StorageSecret)
	so := object.StoreOptions{Client: c, Fingerprint: fp, BlockBytes: int(blockBytes),
		Registry: object.NewRegistry(o.NumBlocks), Key: key, Logger: log}
	g4StoreOptions(o, &so)
	s, err := object.NewStore(so)
	if err != nil {
		return nil, nil, withCode(statusConfig, err)
	}
	log.Info("kvbm G4 tier", "endpoint", o.Endpoint, "bucket", bucket, "region", o.Region,
		"fingerprint", fp.String(), "write_through", o.WriteThrough, "registry_blocks", o.NumBlocks,
		"block_bytes", blockBytes, "mac_key_from", key.Source())
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

// clearRank0Fingerprint forgets fp when its worker goes away.
func clearRank0Fingerprint(fp fingerprint.Fingerprint) {
	g4.mu.Lock()
	if g4.rank0 == fp {
		g4.rank0 = fingerprint.Fingerprint{}
	}
	g4.mu.Unlock()
}

func rank0Fingerprint() fingerprint.Fingerprint {
	g4.mu.Lock()
	defer g4.mu.Unlock()
	return g4.rank0
}

// leaderG4 configures the leader's G4 tier (nil when off). Rank 0's store
// (lookups, the registry) is opened when its fingerprint is known: given in
// the options, or from this process's rank 0 worker; otherwise the engine
// adapter passes it later (kvbm_leader_set_g4_fingerprint, from what rank 0's
// worker reports), and until then the leader plans uploads but matches
// nothing in G4.
func leaderG4(o *leaderOptions, cfg *config.Config, h *leaderHandle, log *slog.Logger) (*leader.G4Options, error) {
	if !cfg.Object.Enabled {
		return nil, nil
	}
	if err := cfg.CheckObject(); err != nil {
		return nil, withCode(statusConfig, err)
	}
	opts := &leader.G4Options{Async: o.G4Async, WriteThrough: cfg.Object.WriteThrough,
		Registry: object.NewRegistry(cfg.Object.NumBlocks)}
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
		log.Info("kvbm G4: waiting for rank 0's block fingerprint from its worker before matching in G4")
		return opts, nil
	}
	s, closeFn, err := openG4(cfg, fp, o.BytesPerBlock, o.WorkerID, log)
	if err != nil {
		return nil, err
	}
	h.g4Close, opts.Store = closeFn, s
	return opts, nil
}

// kvbm_leader_set_g4_fingerprint gives the leader rank 0's block
// fingerprint (32 hex digits, as kvbm_worker_info reports it): its G4
// lookups start. A leader that already has it, or has no G4 tier, ignores it.
//
//export kvbm_leader_set_g4_fingerprint
func kvbm_leader_set_g4_fingerprint(hd C.uint64_t, fpHex *C.char, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	fp, err := fingerprint.Parse(C.GoString(fpHex))
	if err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_set_g4_fingerprint: %v", err), errOut)
	}
	return finish(h.setG4Fingerprint(fp), errOut)
}

// setG4Fingerprint opens rank 0's store for the leader (see
// kvbm_leader_set_g4_fingerprint). It does no network I/O: G4 turns on
// when the store's bucket check succeeds.
func (h *leaderHandle) setG4Fingerprint(fp fingerprint.Fingerprint) error {
	h.g4mu.Lock()
	defer h.g4mu.Unlock()
	if !h.l.G4Enabled() || h.l.G4Store() != nil {
		return nil
	}
	s, closeFn, err := openG4(h.cfg, fp, h.bytesPerBlock, h.workerID, kvbmLogger())
	if err != nil {
		return err
	}
	if !h.l.SetG4Store(s) {
		closeFn()
		return nil
	}
	h.g4Close = closeFn
	kvbmLogger().Info("kvbm G4: matching with rank 0's fingerprint once its bucket answers", "fingerprint", fp.String())
	return nil
}

// g4Report is what a worker tells its leader, when they may live in
// different processes: the hashes it stored since the last report and its
// process's G4 counters.
type g4Report struct {
	Pid    int          `msgpack:"pid"`
	Acked  []uint64     `msgpack:"acked"`
	Stats  object.Stats `msgpack:"stats"`
	Source string       `msgpack:"source"`
}

// kvbm_worker_g4_report returns a msgpack g4Report (empty without a G4 tier).
//
//export kvbm_worker_g4_report
func kvbm_worker_g4_report(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_worker_g4_report", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	*out, *outLen = nil, 0
	if h.g4 == nil {
		return statusOK
	}
	b, err := msgpack.Marshal(g4Report{Pid: os.Getpid(), Acked: h.g4.TakeAcked(), Stats: object.Local(),
		Source: fmt.Sprintf("pid-%d", os.Getpid())})
	if err != nil {
		return finish(fmt.Errorf("encode G4 report: %w", err), errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}

// kvbm_leader_g4_report takes a worker's report: its stored hashes join the
// leader's registry, and the counters of a worker in another process are
// served on this process's metrics endpoint.
//
//export kvbm_leader_g4_report
func kvbm_leader_g4_report(hd C.uint64_t, buf unsafe.Pointer, n C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := leaderOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn("kvbm_leader_g4_report", "report buffer", buf, n); err != nil {
		return finish(err, errOut)
	}
	var r g4Report
	if err := msgpack.Unmarshal(goBytes(buf, n), &r); err != nil {
		return finish(errorf(statusInvalid, "kvbm_leader_g4_report: %v", err), errOut)
	}
	h.l.G4Stored(r.Acked)
	if r.Pid != os.Getpid() && r.Source != "" {
		object.SetRemote(r.Source, r.Stats)
	}
	return statusOK
}
