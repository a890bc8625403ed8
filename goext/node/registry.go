package node

import (
	"fmt"
	"log/slog"
	"sync"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/wire"
)

// Registry is where the components of one process meet without being
// handed to each other. An engine creates its leader and its workers
// independently (vLLM: the scheduler-side and worker-side connector
// objects, in one process with tensor parallelism 1), so what they share
// is found here:
//
//   - the G4 stores, one per fingerprint, counted by reference: the leader
//     and the rank 0 worker of a process share rank 0's store, and with it
//     its registry, so the leader knows at once what the worker uploaded;
//   - the fingerprint of this process's rank 0 worker: a leader started
//     without one looks G4 up under it;
//   - what each rank's persistent disk tier recovered: a leader of the
//     same process registers it at start (RecoveredRank);
//   - the metric set every worker of the process records into
//     (WorkerMetrics); the leader's endpoint serves its transfer families;
//   - the side channel's in-process hubs (wire.InProcHubs): a leader and
//     its ranks in one process meet there by endpoint;
//   - the page stores' metrics endpoint: every store of the process (one
//     per SGLang pool) is served by the first one's.
//
// Two more process-wide meeting points stay in the packages whose protocol
// they are part of, and are listed here so that this is the one place
// naming them all: goext/object's G4 counters (object.Local,
// object.SetRemote: every store of the process counts into them, and the
// leader's metrics endpoint serves them with the counters other processes
// report), and goext/policy's transfer hub (policy.ReportTransfer,
// SubscribeTransfers: the workers of the process report their timed load
// batches, the leader's load-cost model hears them).
//
// Process returns the process's Registry; tests build their own with
// NewRegistry so that they share nothing.
type Registry struct {
	g4mu   sync.Mutex // guards stores and rank0; held while a store opens (no network I/O)
	stores map[fingerprint.Fingerprint]*g4Ref
	rank0  fingerprint.Fingerprint

	recMu     sync.Mutex // guards recovered and recSeq
	recovered map[int]RecoveredRank
	recSeq    uint64 // numbers the offers, so a closing worker withdraws only its own

	workerMetrics func() *metrics.Metrics
	hubs          *wire.InProcHubs
	pageStores    pageStoreMetrics // the page stores' metrics endpoint (pagestore.go)
}

type g4Ref struct {
	s    *object.Store
	refs int
}

// NewRegistry returns an empty Registry.
func NewRegistry() *Registry {
	return &Registry{
		stores:        map[fingerprint.Fingerprint]*g4Ref{},
		recovered:     map[int]RecoveredRank{},
		workerMetrics: sync.OnceValue(metrics.New),
		hubs:          wire.NewInProcHubs(),
	}
}

// process is the Registry of the components the C ABI creates: the one
// package-level variable of the assembly.
var process = NewRegistry()

// Process is the process's Registry.
func Process() *Registry { return process }

// WorkerMetrics is the metric set every worker built with this registry
// records into.
func (r *Registry) WorkerMetrics() *metrics.Metrics { return r.workerMetrics() }

// StoreTuner completes the options of a G4 store the registry opens (the
// background bucket check, by default).
type StoreTuner func(o *config.Object, so *object.StoreOptions)

// DefaultStoreTuner checks the store's bucket in the background, never on
// the caller's thread.
func DefaultStoreTuner(o *config.Object, so *object.StoreOptions) {
	so.BucketCheck = &object.BucketCheck{Region: o.Region}
}

// OpenG4 returns the process's store for fp (creating it: client, upload
// queue); release drops the reference and closes the store with the last
// one. It never waits on the network (the engine's scheduler thread calls
// it): the bucket is checked, and created when missing, in the background
// (tune decides how; nil: DefaultStoreTuner); while that check fails the
// leader leaves G4 off (goext/object/bucketcheck.go).
func (r *Registry) OpenG4(cfg *config.Config, fp fingerprint.Fingerprint, blockBytes int64, workerID uint64,
	log *slog.Logger, tune StoreTuner) (*object.Store, func(), error) {
	o := &cfg.Object
	r.g4mu.Lock()
	defer r.g4mu.Unlock()
	if ref, ok := r.stores[fp]; ok {
		ref.refs++
		return ref.s, r.releaser(fp), nil
	}
	bucket := o.BucketFor(workerID)
	c, err := object.NewClient(object.ClientOptions{Host: o.Host, Secure: o.Secure, Region: o.Region,
		Bucket: bucket, AccessKey: o.AccessKey, SecretKey: o.SecretKey})
	if err != nil {
		// errprefix: the message names the variable, as config's errors do
		return nil, nil, withKind(KindConfig, fmt.Errorf("%s=%q: %w", config.EnvObjectEndpoint, o.Endpoint, err))
	}
	key := c.ObjectKey(cfg.StorageSecret)
	so := object.StoreOptions{Client: c, Fingerprint: fp, BlockBytes: int(blockBytes),
		Registry: object.NewRegistry(o.NumBlocks), Key: key, Logger: log}
	if tune == nil {
		tune = DefaultStoreTuner
	}
	tune(o, &so)
	s, err := object.NewStore(so)
	if err != nil {
		return nil, nil, withKind(KindConfig, err)
	}
	log.Info("kvbm G4 tier", "endpoint", o.Endpoint, "bucket", bucket, "region", o.Region,
		"fingerprint", fp.String(), "write_through", o.WriteThrough, "registry_blocks", o.NumBlocks,
		"block_bytes", blockBytes, "mac_key_from", key.Source())
	r.stores[fp] = &g4Ref{s: s, refs: 1}
	return s, r.releaser(fp), nil
}

// releaser drops one reference to fp's store; calling it twice drops one.
func (r *Registry) releaser(fp fingerprint.Fingerprint) func() {
	var once sync.Once
	return func() { once.Do(func() { r.releaseG4(fp) }) }
}

func (r *Registry) releaseG4(fp fingerprint.Fingerprint) {
	r.g4mu.Lock()
	ref, ok := r.stores[fp]
	if ok {
		if ref.refs--; ref.refs == 0 {
			delete(r.stores, fp)
		} else {
			ref = nil
		}
	}
	r.g4mu.Unlock()
	if ref != nil {
		ref.s.Close()
	}
}

// OpenStores is how many G4 stores the registry holds open.
func (r *Registry) OpenStores() int {
	r.g4mu.Lock()
	defer r.g4mu.Unlock()
	return len(r.stores)
}

// setRank0 records the fingerprint of this process's rank 0 worker.
func (r *Registry) setRank0(fp fingerprint.Fingerprint) {
	r.g4mu.Lock()
	r.rank0 = fp
	r.g4mu.Unlock()
}

// clearRank0 forgets fp when its worker goes away.
func (r *Registry) clearRank0(fp fingerprint.Fingerprint) {
	r.g4mu.Lock()
	if r.rank0 == fp {
		r.rank0 = fingerprint.Fingerprint{}
	}
	r.g4mu.Unlock()
}

// Rank0Fingerprint is the fingerprint of this process's rank 0 worker with
// a G4 tier; zero without one.
func (r *Registry) Rank0Fingerprint() fingerprint.Fingerprint {
	r.g4mu.Lock()
	defer r.g4mu.Unlock()
	return r.rank0
}
