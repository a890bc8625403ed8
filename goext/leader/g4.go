package leader

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// G4 (object storage shared by every engine instance, package object).
//
// Matching continues G2 prefix → G3 continuation → G4 continuation. What is
// in G4 comes from a registry of known stored blocks (filled by this
// process's workers' uploads when they share it, and by lookups) and, for
// blocks other instances stored, from the store itself: a background lookup
// (parallel HEAD requests with a deadline) per request. The scheduler never
// waits on the network:
//
//   - With G4Options.Async (vLLM: get_num_new_matched_tokens may answer
//     "not ready yet"), GetNumNewMatchedTokens returns Pending while the
//     request's lookup runs, and the engine asks again on a later step.
//   - Without it, matching uses what the registry knows now; the lookup
//     fills it for the next request with the same prefix.
//
// A request is looked up once: after its lookup finished, the registry
// alone answers for it. With the store unavailable (its circuit breaker
// open), no lookup starts and nothing is pending.
//
// The store's bucket is checked in the background (object.BucketCheck), so
// a blackholed endpoint never stalls the scheduler. From the check's first
// failure until one succeeds (object.Store.Unavailable) G4 is off for the
// leader: nothing matches in G4, nothing is pending, no upload is planned.
//
// Loads: each matched G4 block gets a G2 bounce block at
// UpdateStateAfterAlloc (allocated and pinned like a load source, never
// registered), and the load carries G4 → G2 then G2 → G1; the bounce goes
// back to the free list when the load finished. A failed download fails
// that G1 block (LoadErrors), which also forgets the hash in the registry.
//
// Uploads: every block saved into G2 that the registry does not know is
// uploaded after the step's saves (plan.Step.Uploads). With write-through
// off, the G2 copy is released in the next step, once the upload was
// queued.

// Pending is what GetNumNewMatchedTokens returns, with async false, while a
// G4 lookup for the request runs (only with G4Options.Async).
const Pending = -1

// G4Store is what the leader uses of rank 0's G4 store: declared here, where
// it is used (like worker.G1Copier), and met by *object.Store; unit tests
// give the leader an in-memory one.
type G4Store interface {
	// Registry holds the hashes known to be stored; the leader matches
	// against it and watches it for tier events.
	Registry() *object.Registry
	// Ready: the store's bucket answered (G4 fully on); Unavailable: its
	// bucket check keeps failing (G4 off until it succeeds); Available:
	// its circuit breaker is closed (lookups may go to the network).
	Ready() bool
	Unavailable() bool
	Available() bool
	// Lookup returns how many leading hashes are stored, asking the
	// network for those the registry does not know until ctx ends; found
	// hashes join the registry.
	Lookup(ctx context.Context, hashes []uint64) int
	// LookupSalted is Lookup for the blocks of a salted request (their
	// objects live under the salt's tag prefix).
	LookupSalted(ctx context.Context, salt uint64, hashes []uint64) int
	// PurgeSalt, PurgeAll and PurgeHashes delete objects (purge.go); Sweep
	// deletes expired ones, listing at most maxList objects from startAfter
	// (lifecycle.go).
	PurgeSalt(ctx context.Context, salt uint64) (object.PurgeResult, error)
	PurgeAll(ctx context.Context, all bool) (object.PurgeResult, error)
	PurgeHashes(ctx context.Context, salt uint64, hashes []uint64) (object.PurgeResult, error)
	Sweep(ctx context.Context, now time.Time, ttl time.Duration, maxList int, startAfter string) (string, object.PurgeResult, error)
}

// G4Options enable the G4 tier in the leader.
type G4Options struct {
	// Store is rank 0's store: its registry and its lookups (uploads and
	// downloads are the workers'). It may come later (SetG4Store: the
	// leader learns rank 0's fingerprint from its worker); until then the
	// leader plans uploads but matches only what Registry knows. While the
	// store is Unavailable, G4 is off.
	Store G4Store
	// Registry of known G4 blocks when Store is nil (nil: 100,000 blocks).
	Registry *object.Registry
	// Async: the engine asks again when told Pending.
	Async bool
	// WriteThrough keeps uploaded blocks in G2 (DYN_KVBM_OBJECT_WRITE_THROUGH).
	WriteThrough bool
	// LookupTimeout bounds one request's lookup
	// (DYN_KVBM_OBJECT_LOOKUP_TIMEOUT_SECS; 0: config.DefaultObjectLookupTimeout);
	// MaxLookupBlocks bounds the blocks it asks about (0: 2,048).
	LookupTimeout   time.Duration
	MaxLookupBlocks int
	// StoreWait: with Async and no Store yet, how long after start a match
	// answers Pending waiting for it (0: 10 s). The engine's worker reports
	// rank 0's fingerprint with its first step's output, which vLLM runs even
	// while every request waits.
	StoreWait time.Duration
	// Events, when set, receives a store (events.HolderKvbmObject) for
	// every block that enters the leader's G4 registry and a removal for
	// every block that leaves it (evicted from the registry, or dropped
	// after a failed or unverifiable download): the blocks this leader
	// believes the bucket holds. Blocks already in the registry when the
	// leader starts watching it are announced then; when SetG4Store replaces
	// the registry, the old one's blocks are removed first.
	Events events.Sink
}

type g4State struct {
	opts      G4Options
	storeWait time.Time // Async without a store: Pending until then
	reg       *object.Registry
	probes    map[string]*g4Probe
	release   []tierHash      // G2 blocks to release next step (write-through off)
	unwatch   func() []uint64 // stops the Events watch of reg (nil without Events)
}

type g4Probe struct {
	done bool
	// alt: state keys of the positions asked (g4Match), looked up for the
	// positions whose block was found.
	alt []uint64
}

// g4StateLookups is how many state keys one wave of g4StateLookup asks.
const g4StateLookups = 8

type tierHash struct {
	idx  int
	hash uint64
}

func newG4State(o *G4Options) *g4State {
	if o == nil {
		return nil
	}
	opts := *o
	if opts.LookupTimeout <= 0 {
		opts.LookupTimeout = config.DefaultObjectLookupTimeout
	}
	if opts.MaxLookupBlocks <= 0 {
		opts.MaxLookupBlocks = 2048
	}
	if opts.StoreWait <= 0 {
		opts.StoreWait = 10 * time.Second
	}
	reg := opts.Registry
	if opts.Store != nil {
		reg = opts.Store.Registry()
	} else if reg == nil {
		reg = object.NewRegistry(100000)
	}
	g := &g4State{opts: opts, reg: reg, probes: make(map[string]*g4Probe)}
	g.watch()
	return g
}

// watch announces g.reg's blocks to opts.Events and follows its changes.
func (g *g4State) watch() {
	sink := g.opts.Events
	if sink == nil {
		return
	}
	held, stop := g.reg.Watch(func(h uint64, added bool) {
		sink.Publish(events.BlockEvent{Removed: !added, Holder: events.HolderKvbmObject, SeqHash: h})
	})
	for _, h := range held {
		sink.Publish(events.BlockEvent{Holder: events.HolderKvbmObject, SeqHash: h})
	}
	g.unwatch = stop
}

// unwatchAll stops following g.reg and announces its blocks removed (the
// leader no longer answers for them).
func (g *g4State) unwatchAll() {
	if g == nil || g.unwatch == nil {
		return
	}
	held := g.unwatch()
	g.unwatch = nil
	for _, h := range held {
		g.opts.Events.Publish(events.BlockEvent{Removed: true, Holder: events.HolderKvbmObject, SeqHash: h})
	}
}

// SetG4Store gives the leader rank 0's store once known (see G4Options);
// its registry replaces the leader's. It reports false when G4 is off or a
// store is already set.
func (l *Leader) SetG4Store(s G4Store) bool {
	l.mu.Lock()
	defer l.unlock()
	if l.g4 == nil || l.g4.opts.Store != nil || s == nil {
		return false
	}
	l.g4.opts.Store = s
	l.g4.unwatchAll()
	l.g4.reg = s.Registry()
	l.g4.watch()
	return true
}

// StopG4Events stops publishing G4 registry changes to G4Options.Events
// (the leader is going away; a shared store's registry lives on).
func (l *Leader) StopG4Events() {
	l.mu.Lock()
	defer l.unlock()
	if l.g4 != nil && l.g4.unwatch != nil {
		l.g4.unwatch()
		l.g4.unwatch = nil
	}
}

// G4Store is rank 0's store, nil until known or without G4.
func (l *Leader) G4Store() G4Store {
	l.mu.Lock()
	defer l.unlock()
	if l.g4 == nil {
		return nil
	}
	return l.g4.opts.Store
}

// G4Enabled reports whether the leader matches and uploads G4 blocks.
func (l *Leader) G4Enabled() bool { return l.g4 != nil }

// G4On reports whether G4 is fully on: configured, rank 0's store known,
// and its bucket check succeeded.
func (l *Leader) G4On() bool {
	l.mu.Lock()
	defer l.unlock()
	return l.g4 != nil && l.g4.opts.Store != nil && l.g4.opts.Store.Ready()
}

// off reports whether G4 is off for now: rank 0's store is known but its
// bucket check failed and has not succeeded since.
func (g *g4State) off() bool { return g.opts.Store != nil && g.opts.Store.Unavailable() }

// g4Match returns how many leading hashes of rest are in G4, or pending.
// Called with l.mu held.
//
// With recurrent-state groups, alt gives each of rest's state keys
// (hashing.StateHash): the lookup asks for those of the positions found as
// well, so that a hit can end on a stored state (stateCut).
func (l *Leader) g4Match(reqID string, salt uint64, rest, alt []uint64) (n int, pending bool) {
	g := l.g4
	if g == nil || len(rest) == 0 || g.off() {
		return 0, false
	}
	n = g.reg.PrefixLen(rest)
	// A state model's hit also needs the state at its end: a probe asks for
	// it unless the registry knows the last found position's already.
	wantState := alt != nil && n > 0 && !g.reg.Contains(alt[n-1])
	if n < len(rest) || wantState {
		p := g.probes[reqID]
		switch {
		case p == nil && g.opts.Store != nil && g.opts.Store.Available():
			p = &g4Probe{}
			g.probes[reqID] = p
			end := min(len(rest), n+g.opts.MaxLookupBlocks)
			ask := append([]uint64(nil), rest[n:end]...)
			if alt != nil {
				p.alt = append([]uint64(nil), alt[:end]...)
			}
			go l.g4Lookup(g.opts.Store, p, salt, ask)
			if g.opts.Async {
				return 0, true
			}
		case p != nil && !p.done && g.opts.Async:
			return 0, true
		case g.opts.Store == nil && g.opts.Async && l.now().Before(g.storeWait):
			return 0, true // rank 0's fingerprint is on its way
		}
	}
	object.CountLookup(n, len(rest)-n)
	return n, false
}

// g4Lookup runs one request's lookup off the scheduler's thread.
func (l *Leader) g4Lookup(s G4Store, p *g4Probe, salt uint64, hashes []uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), l.g4.opts.LookupTimeout)
	defer cancel()
	start := l.now()
	found := 0
	if len(hashes) > 0 {
		found = s.LookupSalted(ctx, salt, hashes) // found hashes join the registry
	}
	if ctx.Err() != nil {
		l.log.Warn("kvbm G4: lookup ran out of time; the request loads what was found by then",
			"blocks_asked", len(hashes), "found", found, "timeout", l.g4.opts.LookupTimeout)
	}
	if known := len(p.alt) - len(hashes) + found; len(p.alt) > 0 && known > 0 {
		// The positions found before the lookup and by it.
		l.g4StateLookup(s, salt, p.alt[:known])
	}
	took := l.now().Sub(start)
	l.mu.Lock()
	p.done = true
	if m := l.pol.model; m != nil {
		// The registry knew none of hashes: this asked the bucket, one HEAD
		// request when the first block is missing, else waves of them.
		waves := 1
		if found > 0 {
			waves = policy.LookupWaves(len(hashes), l.pol.shape.LookupConcurrency)
		}
		m.ObserveLookup(took, waves)
	}
	l.unlock()
}

// g4StateLookup asks the bucket for the state keys of a request's
// positions (alt: hashing.StateHash of each, in prompt order), from the
// last backward in waves of g4StateLookups, until a wave finds one: a hit
// ends on the last position with a stored state (stateCut), and state keys
// exist only where a step ended, so a missing one must not hide the ones
// before it. The states get a deadline of their own, so that a slow block
// lookup does not leave a hit without its state.
func (l *Leader) g4StateLookup(s G4Store, salt uint64, alt []uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), l.g4.opts.LookupTimeout)
	defer cancel()
	for end := len(alt); end > 0 && ctx.Err() == nil; end -= g4StateLookups {
		wave := alt[max(0, end-g4StateLookups):end]
		var hit atomic.Bool
		var wg sync.WaitGroup
		for _, h := range wave {
			wg.Go(func() {
				if s.LookupSalted(ctx, salt, []uint64{h}) > 0 {
					hit.Store(true)
				}
			})
		}
		wg.Wait()
		if hit.Load() {
			return
		}
	}
	if ctx.Err() != nil {
		l.log.Warn("kvbm G4: state lookup ran out of time; the request's hit ends on a state found elsewhere or loads nothing",
			"positions", len(alt), "timeout", l.g4.opts.LookupTimeout)
	}
}

// g4Forget drops a finished request's lookup state. l.mu held.
func (l *Leader) g4Forget(reqID string) {
	if l.g4 != nil {
		delete(l.g4.probes, reqID)
	}
}

// g4Bounce allocates the G2 block a G4 source downloads into; false when
// every G2 block is pinned. l.mu held.
func (l *Leader) g4Bounce(src *source) bool {
	idx, ok := l.allocate(l.host)
	if !ok {
		return false
	}
	src.idx = idx
	return true
}

// releaseSource drops the reference a staged or loading source holds (a G4
// source holds its bounce block once allocated). l.mu held.
func (l *Leader) releaseSource(src source) {
	if src.tier == plan.G4 && src.idx < 0 {
		return
	}
	l.poolOf(src.tier).Unpin(src.idx)
}

// planUpload queues G2 block idx (just saved under h) for G4. l.mu held.
func (l *Leader) planUpload(st *plan.Step, idx int, h, parent, salt uint64) {
	g := l.g4
	if g == nil || g.off() || g.reg.Contains(h) || !l.admitUpload(h) {
		return
	}
	st.Uploads = append(st.Uploads, plan.Upload{Block: int64(idx), Hash: h, Parent: parent})
	noteSalt(st, h, salt)
	if !g.opts.WriteThrough {
		g.release = append(g.release, tierHash{idx, h})
	}
}

// g4ReleaseUploaded forgets G2 blocks uploaded in the previous step
// (write-through off): their upload copied them already. l.mu held.
func (l *Leader) g4ReleaseUploaded() {
	g := l.g4
	if g == nil || len(g.release) == 0 {
		return
	}
	for _, b := range g.release {
		if l.host.Holds(b.idx, b.hash) {
			idx, _ := l.host.Invalidate(b.hash)
			l.dropIfFree(l.host, idx)
		}
	}
	g.release = g.release[:0]
}

// G4Stored records hashes rank 0's worker reported stored in G4 (its
// upload acknowledgements, when it runs in another process).
func (l *Leader) G4Stored(hashes []uint64) {
	l.mu.Lock()
	defer l.unlock()
	if l.g4 == nil {
		return
	}
	for _, h := range hashes {
		l.g4.reg.Add(h)
	}
}

// g4LoadFailed forgets a hash whose download failed. l.mu held.
func (l *Leader) g4LoadFailed(h uint64) {
	if l.g4 != nil {
		l.g4.reg.Remove(h)
	}
}

// noteSalt records the salt of a salted block st's G4 copies or uploads
// name (its object key carries the salt's tag).
func noteSalt(st *plan.Step, h, salt uint64) {
	if salt != 0 && salt != hashing.DefaultSaltHash {
		st.G4Salts = append(st.G4Salts, plan.SaltRef{Hash: h, Salt: salt})
	}
}
