package leader

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/pool"
)

// Purge (design §12): forget a tenant's blocks (a cache salt), a prompt
// prefix and everything after it, or everything, in every tier this leader
// answers for.
//
// G2 and G3 blocks are found by scanning the pools: a block's sequence hash
// is a function of its parent's, its tokens and the salt hash, so "is this
// block of salt s" is one XXH3 of its tokens and one chain hash, with no
// salt stored anywhere. A block kept without its tokens (a persistent G3
// block of more than 984 tokens) cannot be checked and goes with any salt
// purge. Purged blocks leave the registries at once (REMOVE events to the
// router's index, the consolidator and the engine's tier-event stream), are
// dropped by the workers in the next step, and in a persistent G3 tier are
// recorded as tombstones first (tombstone.go), so that a restart before that
// step does not bring them back. G4 objects are deleted in the bucket:
// a salt's under its key prefix (goext/object's salt.go), a prefix's by key
// under every fingerprint (every rank's),
// everything by listing kvbm's objects.

// PurgeRequest says what to purge: exactly one of Salts, Prefix or All.
type PurgeRequest struct {
	// Salts are salt hashes (hashing.SaltHash of a cache salt and LoRA
	// name); every block of each goes.
	Salts []uint64
	// Prefix: the full blocks of these prompt tokens, hashed under
	// PrefixSalt (0: the default salt), and every block that continues
	// them.
	Prefix     []uint32
	PrefixSalt uint64
	// All: every block of every tier, and every kvbm object in the bucket.
	All bool
}

// PurgeResult is what one purge removed.
type PurgeResult struct {
	HostBlocks  int `json:"host_blocks"`  // G2 blocks forgotten
	DiskBlocks  int `json:"disk_blocks"`  // G3 blocks forgotten
	G4Forgotten int `json:"g4_forgotten"` // hashes the G4 registry forgot (deleted objects included)
	G4Listed    int `json:"g4_listed"`    // objects listed (or named, for a prefix)
	G4Deleted   int `json:"g4_deleted"`   // objects deleted
	G4Failed    int `json:"g4_failed"`    // deletes that failed
	// G4Skipped says why the bucket was not touched ("" when it was, or
	// when there is no G4 tier).
	G4Skipped string `json:"g4_skipped,omitempty"`
}

func (r PurgeRequest) check(bs int) error {
	n := 0
	if len(r.Salts) > 0 {
		n++
	}
	if len(r.Prefix) > 0 {
		n++
	}
	if r.All {
		n++
	}
	switch {
	case n != 1:
		return errors.New("leader: purge: give exactly one of salts, prefix tokens or all")
	case len(r.Prefix) > 0 && len(r.Prefix) < bs:
		return fmt.Errorf("leader: purge: prefix of %d tokens is shorter than one block (%d tokens): it names no block", len(r.Prefix), bs)
	}
	for _, s := range r.Salts {
		if s == 0 || s == hashing.DefaultSaltHash {
			return errors.New("leader: purge: the default salt (no cache salt, no LoRA) names no tenant; purge prefixes or all")
		}
	}
	return nil
}

// Purge removes what req names from every tier (see the comment above)
// and returns what it removed. The G2/G3 part runs under the leader's lock
// (a scan of both pools); the bucket's part after it, bounded by ctx. An
// error from the bucket comes back with the counts of what was done.
func (l *Leader) Purge(ctx context.Context, req PurgeRequest) (PurgeResult, error) {
	var res PurgeResult
	if err := req.check(l.bs); err != nil {
		return res, err
	}
	var prefix []uint64
	if len(req.Prefix) > 0 {
		salt := req.PrefixSalt
		if salt == 0 {
			salt = hashing.DefaultSaltHash
		}
		prefix = hashing.SequenceHashes(req.Prefix, l.bs, salt, nil)
	}
	l.mu.Lock()
	var doomed map[uint64]struct{}
	if prefix != nil {
		doomed = l.descendants(prefix)
	}
	match := func(info pool.BlockInfo) bool {
		switch {
		case req.All:
			return true
		case doomed != nil:
			_, ok := doomed[info.SeqHash]
			return ok
		}
		for _, s := range req.Salts {
			if ofSalt(info, s) {
				return true
			}
		}
		return false
	}
	var tombs []tombstone
	res.HostBlocks, _ = l.purgePool(l.host, match, nil)
	res.DiskBlocks, tombs = l.purgePool(l.disk, match, tombs)
	terr := l.life.tombs.add(tombs)
	if res.HostBlocks+res.DiskBlocks > 0 {
		l.gen++ // open background tickets free their blocks instead of registering them
		l.updateGauges()
	}
	var store G4Store
	if l.g4 != nil {
		store = l.g4.opts.Store
		reg := l.g4.reg
		switch {
		case req.All:
			res.G4Forgotten = reg.RemoveAll()
		case doomed != nil:
			for h := range doomed {
				if reg.Contains(h) {
					reg.Remove(h)
					res.G4Forgotten++
				}
			}
		}
	}
	l.unlock()
	l.life.purges.Add(1)
	l.m.Purges.Inc()
	l.m.PurgedBlocks.WithLabelValues("g2").Add(float64(res.HostBlocks))
	l.m.PurgedBlocks.WithLabelValues("g3").Add(float64(res.DiskBlocks))

	if l.g4 == nil {
		return res, terr
	}
	if store == nil {
		res.G4Skipped = "rank 0's G4 store is not known yet (it comes with the first engine step)"
		return res, terr
	}
	before := store.Registry().Len()
	var g object.PurgeResult
	var err error
	switch {
	case req.All:
		g, err = store.PurgeAll(ctx, true)
	case prefix != nil:
		hashes := make([]uint64, 0, len(doomed))
		for h := range doomed {
			hashes = append(hashes, h)
		}
		salt := req.PrefixSalt
		g, err = store.PurgeHashes(ctx, salt, hashes)
	default:
		for _, s := range req.Salts {
			one, e := store.PurgeSalt(ctx, s)
			g.Listed += one.Listed
			g.Deleted += one.Deleted
			g.Failed += one.Failed
			err = errors.Join(err, e)
		}
		l.recheckLater(store, req.Salts)
	}
	if !req.All && prefix == nil {
		res.G4Forgotten += max(before-store.Registry().Len(), 0)
	}
	res.G4Listed, res.G4Deleted, res.G4Failed = g.Listed, g.Deleted, g.Failed
	l.m.PurgedBlocks.WithLabelValues("g4").Add(float64(g.Deleted))
	if err != nil {
		err = fmt.Errorf("leader: purge: G4: %w", err)
	}
	return res, errors.Join(terr, err)
}

// ofSalt reports whether a registered block was hashed under salt hash s:
// its sequence hash is recomputed from its tokens and parent. A block kept
// without its tokens cannot be checked and counts as of every salt.
func ofSalt(info pool.BlockInfo, s uint64) bool {
	if len(info.Tokens) == 0 {
		return true
	}
	h := hashing.BlockHash(info.Tokens, s)
	if info.HasParent {
		h = hashing.ChainHash(info.Parent, h, s)
	}
	return h == info.SeqHash
}

// descendants returns prefix's hashes and those of every G2/G3 block that
// continues one of them (children by parent link, transitively). l.mu held.
func (l *Leader) descendants(prefix []uint64) map[uint64]struct{} {
	children := make(map[uint64][]uint64)
	for _, p := range []*pool.Pool{l.host, l.disk} {
		if p == nil {
			continue
		}
		for _, idx := range p.Registered(nil) {
			info := p.Info(idx)
			if info.HasParent {
				children[info.Parent] = append(children[info.Parent], info.SeqHash)
			}
		}
	}
	doomed := make(map[uint64]struct{}, len(prefix))
	queue := append([]uint64(nil), prefix...)
	for len(queue) > 0 {
		h := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		if _, seen := doomed[h]; seen {
			continue
		}
		doomed[h] = struct{}{}
		queue = append(queue, children[h]...)
	}
	return doomed
}

// purgePool invalidates p's registered blocks that match, dropping them in
// the next step; a persistent G3 tier's are appended to tombs. l.mu held.
func (l *Leader) purgePool(p *pool.Pool, match func(pool.BlockInfo) bool, tombs []tombstone) (int, []tombstone) {
	if p == nil {
		return 0, tombs
	}
	n := 0
	for _, idx := range p.Registered(l.idxBuf[:0]) {
		info := p.Info(idx)
		if !match(info) {
			continue
		}
		p.Invalidate(info.SeqHash)
		l.dropIfFree(p, idx)
		if p == l.disk && l.tagSteps() {
			tombs = append(tombs, tombstone{block: int64(idx), hash: info.SeqHash})
		}
		n++
	}
	return n, tombs
}

// PurgeRecheck is how long after a salt purge its G4 prefix is listed and
// purged once more: uploads the workers had queued before the purge (at
// most 256 per rank, written within seconds) may land after the first pass.
var PurgeRecheck = 30 * time.Second

// recheckLater runs that second pass in the background (ended by Close).
func (l *Leader) recheckLater(store G4Store, salts []uint64) {
	lc := l.life
	salts = append([]uint64(nil), salts...)
	wait := PurgeRecheck
	lc.bgWG.Add(1)
	go func() {
		defer lc.bgWG.Done()
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-lc.bg.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(lc.bg, time.Minute)
		defer cancel()
		for _, s := range salts {
			res, err := store.PurgeSalt(ctx, s)
			l.m.PurgedBlocks.WithLabelValues("g4").Add(float64(res.Deleted))
			if res.Deleted > 0 || err != nil {
				l.log.Info("kvbm purge: second pass over the salt's G4 objects", "deleted", res.Deleted, "err", err)
			}
		}
	}()
}
