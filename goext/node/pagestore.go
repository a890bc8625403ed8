package node

import (
	"fmt"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/pagestore"
)

// PageStoreSpec is what the engine tells the page store (goext/pagestore,
// behind SGLang's HiCache backend).
type PageStoreSpec struct {
	Identity  string // what makes two pages of one key interchangeable
	PageBytes int64
	Rank      int
}

// PageStore is a page store assembled: the store and its G4 store.
type PageStore struct {
	S       *pagestore.Store
	closers undo
}

// NewPageStore opens a page store in the disk tier cfg configures, with
// the object tier when DYN_KVBM_OBJECT_* configure one. fn names the
// caller in its errors. On error what was opened is closed.
func NewPageStore(cfg *config.Config, spec PageStoreSpec, fn string, d Deps) (_ *PageStore, err error) {
	if !cfg.DiskEnabled() {
		// errprefix: the message names the caller (fn), as before the assembly moved here
		return nil, withKind(KindConfig, fmt.Errorf("%s: the disk tier is not configured: set DYN_KVBM_DISK_CACHE_GB "+
			"(or DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS); pages are stored there", fn))
	}
	pages := cfg.DiskBlocks(spec.PageBytes)
	if pages <= 0 {
		// errprefix: the message names the caller (fn)
		return nil, withKind(KindConfig, fmt.Errorf("%s: DYN_KVBM_DISK_CACHE_GB=%g holds no page of %d bytes", fn,
			cfg.DiskCacheGB, spec.PageBytes))
	}
	key, err := g3Key(cfg)
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	log := d.logger()
	so := pagestore.Options{
		Dir: cfg.DiskCacheDir, NumPages: pages, PageBytes: spec.PageBytes, Identity: spec.Identity, Rank: spec.Rank,
		Persist: cfg.DiskPersist, DisableODirect: cfg.DiskDisableODirect,
		OpenDirect: cfg.DiskAllocatorType == config.DiskAllocatorOpenDirect, Key: key, Logger: log,
	}
	n := &PageStore{}
	defer func() {
		if err != nil {
			n.closers.run()
		}
	}()
	if cfg.Object.Enabled {
		// The object tier (DYN_KVBM_OBJECT_*), under the store's fingerprint.
		obj, release, err := d.registry().OpenG4(cfg, pagestore.Fingerprint(spec.Identity), spec.PageBytes,
			uint64(spec.Rank), log, d.TuneStore)
		if err != nil {
			return nil, err
		}
		so.Object = obj
		n.closers.push(release)
	}
	s, err := pagestore.Open(so)
	if err != nil {
		return nil, withKind(KindIO, err)
	}
	n.S = s
	n.closers.push(func() { _ = s.Close() })
	return n, nil
}

// Close closes the store, then releases its G4 store.
func (n *PageStore) Close() { n.closers.run() }
