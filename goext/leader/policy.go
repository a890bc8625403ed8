package leader

import (
	"fmt"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// Load-or-recompute and admission to G3/G4 (goext/policy; design §4.1, §4.2).
//
// Load policy: GetNumNewMatchedTokens keeps the prefix of its match that
// the policy chooses (applyLoadPolicy); the engine recomputes the rest.
// The model learns each tier's cost from the timed batches of the workers
// that share this process (Options.ObserveTransfers) and a prompt token's
// cost from the time between Step calls.
//
// Admission: every (re-)registration of a G2 block counts in the sketch
// (when a tier uses it); G3 copies are queued only when the disk gate
// admits the block, G4 uploads only when the object gate does. Under the
// sketch, a block admitted to G4 after its save (on a later sighting) is
// uploaded from G2 at the next Step (pending).
type policyState struct {
	load    policy.LoadPolicy
	model   *policy.Model
	shape   policy.Shape
	pm      *policy.Metrics
	sketch  *policy.Sketch // nil unless a gate uses it
	disk    *policy.Gate   // nil without G2 and G3
	obj     *policy.Gate   // nil without G4
	pending []tierHash     // G4 uploads admitted after their save
	queued  map[uint64]struct{}
	// recent: hashes uploaded through pending, oldest first, until the
	// registry learns of them from the worker (bounded by G2's size).
	recent     map[uint64]struct{}
	recentFIFO []uint64
	cancel     func() // stops the transfer subscription; nil without one
	// finished: G3/G4 loads reported finished since the last Step, timed
	// end to end at the next one (the step their requests compute in).
	finished []finishedLoad
}

// finishedLoad is a load whose end-to-end wait the next Step measures.
type finishedLoad struct {
	deep    plan.Tier // G3 or G4
	bytes   int64     // one rank's share of the whole load
	decided time.Time
}

// initPolicy sets up l.pol from the configuration. l.m, l.now, l.host,
// l.disk and l.g4 are set.
func (l *Leader) initPolicy(opts Options) error {
	cfg := opts.Config
	lp, err := policy.NewLoadPolicy(cfg.LoadPolicy.Mode, cfg.LoadPolicy.CapMs)
	if err != nil {
		return fmt.Errorf("leader: %w", err)
	}
	p := &l.pol
	p.load = lp
	p.model = policy.NewModel(cfg.LoadPolicy.PrefillUsPerToken)
	p.shape = policy.Shape{BlockTokens: l.bs, MBPerBlock: float64(opts.BytesPerBlock) / 1e6,
		BatchBlocks: cfg.MaxTransferBatchSize, Concurrency: cfg.MaxConcurrentTransfers,
		LookupConcurrency: object.DefaultLookups}
	p.model.SetDownloadWave(object.DownloadsInFlight, p.shape.MBPerBlock)
	p.pm = policy.NewMetrics(l.m.Registry, p.model)
	useSketch := false
	if l.host != nil && l.disk != nil {
		mode := policy.AdmitFrequency
		if cfg.DisableDiskOffloadFilter {
			mode = policy.AdmitAll
		} else if cfg.Admission.Disk != "" {
			if mode, err = policy.ParseAdmit(cfg.Admission.Disk); err != nil {
				return fmt.Errorf("leader: %s: %w", config.EnvDiskAdmission, err)
			}
		}
		// The budget is in MB/s of all ranks' bytes; the gate counts blocks.
		perSec := cfg.Admission.DiskWriteMBps * 1e6 / float64(opts.BytesPerBlock*int64(opts.NumWorkers))
		if p.disk, err = policy.NewGate(mode, perSec, l.now); err != nil {
			return fmt.Errorf("leader: %s: %w", config.EnvDiskWriteMBps, err)
		}
		useSketch = mode == policy.AdmitSketch
	}
	if l.g4 != nil {
		mode := policy.AdmitAll
		if cfg.Admission.Object != "" {
			if mode, err = policy.ParseAdmit(cfg.Admission.Object); err != nil || mode == policy.AdmitFrequency {
				return fmt.Errorf("leader: %s=%q: want all or sketch", config.EnvObjectAdmission, cfg.Admission.Object)
			}
		}
		if p.obj, err = policy.NewGate(mode, cfg.Admission.ObjectPutsPerSec, l.now); err != nil {
			return fmt.Errorf("leader: %s: %w", config.EnvObjectPutsPerSec, err)
		}
		useSketch = useSketch || mode == policy.AdmitSketch
		p.queued = make(map[uint64]struct{})
		p.recent = make(map[uint64]struct{})
	}
	if useSketch {
		if p.sketch, err = policy.NewSketch(policy.DefaultSketchCounters); err != nil {
			return fmt.Errorf("leader: %w", err)
		}
	}
	if opts.ObserveTransfers {
		p.cancel = policy.SubscribeTransfers(p.model.ObserveTransfer)
	}
	return nil
}

// CostModel is the leader's load-cost model (estimates, and measurements
// from outside the process).
func (l *Leader) CostModel() *policy.Model { return l.pol.model }

// applyLoadPolicy cuts srcs (a request's match, in prefix order) to the
// prefix the load policy loads, counting and logging what it leaves to the
// engine. Nothing is pinned yet. l.mu held.
func (l *Leader) applyLoadPolicy(reqID string, srcs []source) []source {
	p := &l.pol
	if p.load.Mode == policy.Always || len(srcs) == 0 {
		return srcs
	}
	tiers := make([]plan.Tier, len(srcs))
	for k, s := range srcs {
		tiers[k] = s.tier
	}
	d := p.model.Decide(p.load, tiers, p.shape)
	for i, n := range d.Skipped {
		if n > 0 {
			p.pm.SkippedTokens.WithLabelValues(policy.TierLabel(policy.Tiers[i]), d.Reason).Add(float64(n * l.bs))
		}
	}
	l.log.Debug("kvbm: load policy", "request", reqID, "policy", p.load.Mode.String(),
		"matched_blocks", len(srcs), "load_blocks", d.Load,
		"skipped_g2", d.Skipped[0], "skipped_g3", d.Skipped[1], "skipped_g4", d.Skipped[2], "reason", d.Reason,
		"expected_load_all_ms", d.LoadAll*1e3, "expected_load_ms", d.LoadChosen*1e3,
		"expected_recompute_all_ms", d.RecomputeAll*1e3, "explored", d.Explored)
	return srcs[:d.Load]
}

// timeLoad gives the model what the leader saw of a finished load: the
// time from the step that emitted it until now (the step that learnt it
// finished), attributed to its slowest tier (G4, else G3) after taking out
// the model's estimate for its other blocks; and queues its end-to-end
// wait (from the load decision), measured at the next Step, when the
// request computes. Loads of G2 alone are not timed this way: the step's
// wait would dwarf a memory copy. l.mu held.
func (l *Leader) timeLoad(il *inflightLoad) {
	p := &l.pol
	if p.model == nil || il.at.IsZero() {
		return
	}
	var n [3]int
	for _, src := range il.sources {
		if i, ok := policy.TierIndex(src.tier); ok {
			n[i]++
		}
	}
	deep := plan.G4
	if n[2] == 0 {
		deep = plan.G3
	}
	i, _ := policy.TierIndex(deep)
	if n[i] == 0 {
		return
	}
	mb := p.shape.MBPerBlock
	if !il.decided.IsZero() {
		p.finished = append(p.finished, finishedLoad{deep: deep,
			bytes: int64(float64(n[0]+n[1]+n[2]) * mb * 1e6), decided: il.decided})
	}
	others := p.model.Tier(plan.G2).Seconds(float64(n[0]+n[2]) * mb)
	if deep == plan.G4 {
		others += p.model.Tier(plan.G3).Seconds(float64(n[1]) * mb)
	}
	d := l.now().Sub(il.at) - time.Duration(others*float64(time.Second))
	p.model.ObserveLoadWait(deep, int64(float64(n[i])*mb*1e6), max(d, 0))
}

// g4WorthLooking reports whether a G4 lookup of the rest blocks of a
// request's match could pay: under a policy other than always, a lookup is
// not started when loading all of them from G4 is expected to lose (cost)
// or to take longer than the bound even for one block (never-slower-than),
// the lookup's own round trips included (measured by g4Lookup). A request
// whose lookup was already started is not asked again: it matches what
// its lookup found (the load decision then leaves the lookup out).
// l.mu held.
func (l *Leader) g4WorthLooking(reqID string, rest int) bool {
	p := &l.pol
	if p.load.Mode == policy.Always || rest <= 0 {
		return true
	}
	if l.g4.probes[reqID] != nil {
		return true // the request's lookup is made or under way: its time is spent either way
	}
	n := rest
	if p.load.Mode == policy.Cap {
		n = 1
	}
	tiers := make([]plan.Tier, n)
	for k := range tiers {
		tiers[k] = plan.G4
	}
	sh := p.shape
	// The lookup comes first: as many waves of HEAD requests as the store
	// issues when every block is there (the best case for loading).
	asked := rest
	if l.g4.opts.MaxLookupBlocks > 0 {
		asked = min(asked, l.g4.opts.MaxLookupBlocks)
	}
	sh.Overhead = p.model.LookupSeconds(asked, sh.LookupConcurrency)
	if d := p.model.Decide(p.load, tiers, sh); d.Load > 0 {
		return true
	}
	p.pm.LookupsSkipped.Inc()
	l.log.Debug("kvbm: load policy: not looking up G4", "request", reqID, "policy", p.load.Mode.String(),
		"blocks", rest)
	return false
}

// observeStep gives the model this step's start and scheduled tokens.
// Loads reported finished since the last step are timed end to end here:
// their requests compute in this step.
func (l *Leader) observeStep(now time.Time, updates []RequestUpdate) {
	if l.pol.model == nil {
		return
	}
	for _, f := range l.pol.finished {
		l.pol.model.ObserveEndToEnd(f.deep, f.bytes, max(now.Sub(f.decided), 0))
	}
	l.pol.finished = l.pol.finished[:0]
	if l.pol.load.Mode == policy.Always {
		return
	}
	n := 0
	for i := range updates {
		n += max(updates[i].NumScheduledTokens, 0)
	}
	l.pol.model.ObserveStep(now, n)
}

// noteAdmission counts one sighting of G2 block idx under h and, under a G4
// sketch, queues its upload once admitted. It returns the block's count
// (policy.MinCount without a sketch). l.mu held.
func (l *Leader) noteAdmission(idx int, h uint64) int {
	p := &l.pol
	if p.sketch == nil {
		return policy.MinCount
	}
	count := p.sketch.Add(h)
	if p.obj != nil && p.obj.Mode() == policy.AdmitSketch && count >= policy.MinCount && !l.g4.off() &&
		!l.g4.reg.Contains(h) {
		_, done := p.recent[h]
		if _, ok := p.queued[h]; !ok && !done && len(p.pending) < l.host.Capacity() {
			p.queued[h] = struct{}{}
			p.pending = append(p.pending, tierHash{idx, h})
		}
	}
	return count
}

// admitDisk decides a G2→G3 copy of a block with sketch count count.
func (l *Leader) admitDisk(count int) bool {
	return l.admit(l.pol.disk, plan.G3, count)
}

func (l *Leader) admit(g *policy.Gate, t plan.Tier, count int) bool {
	if g == nil {
		return true
	}
	ok, why := g.Admit(count)
	if ok {
		l.pol.pm.Admitted.WithLabelValues(policy.TierLabel(t)).Inc()
	} else {
		l.pol.pm.Rejected.WithLabelValues(policy.TierLabel(t), why).Inc()
	}
	return ok
}

// admitUpload decides the upload of a block just saved into G2 under h
// (planUpload). Under the G4 sketch the save's sighting already queued it
// if admitted (noteAdmission), so nothing is uploaded here; a cold block is
// counted as refused.
func (l *Leader) admitUpload(h uint64) bool {
	p := &l.pol
	if p.obj == nil {
		return true
	}
	if p.obj.Mode() == policy.AdmitSketch {
		if p.sketch.Estimate(h) < policy.MinCount {
			p.pm.Rejected.WithLabelValues(policy.TierLabel(plan.G4), policy.RejectCold).Inc()
		}
		return false
	}
	count := policy.MinCount
	if p.sketch != nil {
		count = p.sketch.Estimate(h)
	}
	return l.admit(p.obj, plan.G4, count)
}

// flushAdmittedUploads plans the uploads the G4 sketch admitted after their
// blocks' saves, from G2 blocks that still hold them; each is pinned until
// the step is planned (like a move's source). l.mu held.
func (l *Leader) flushAdmittedUploads(st *plan.Step) {
	p := &l.pol
	if len(p.pending) == 0 {
		return
	}
	for _, b := range p.pending {
		delete(p.queued, b.hash)
		if l.degraded || l.g4.off() || l.g4.reg.Contains(b.hash) || !l.host.Holds(b.idx, b.hash) {
			continue
		}
		if !l.admit(p.obj, plan.G4, p.sketch.Estimate(b.hash)) {
			continue
		}
		info := l.host.Info(b.idx)
		l.host.Pin(b.idx)
		l.moveSrc = append(l.moveSrc, b.idx)
		st.Uploads = append(st.Uploads, plan.Upload{Block: int64(b.idx), Hash: b.hash, Parent: info.Parent})
		if len(p.recentFIFO) >= l.host.Capacity() {
			delete(p.recent, p.recentFIFO[0])
			p.recentFIFO = p.recentFIFO[1:]
		}
		p.recent[b.hash] = struct{}{}
		p.recentFIFO = append(p.recentFIFO, b.hash)
		if !l.g4.opts.WriteThrough {
			l.g4.release = append(l.g4.release, b)
		}
	}
	p.pending = p.pending[:0]
}

// resetPolicy forgets the admission counts (ResetCache).
func (l *Leader) resetPolicy() {
	if l.pol.sketch != nil {
		l.pol.sketch.Reset()
	}
	l.pol.pending = l.pol.pending[:0]
	clear(l.pol.queued)
	clear(l.pol.recent)
	l.pol.recentFIFO = nil
}

// closePolicy stops following the workers' transfers.
func (l *Leader) closePolicy() {
	if l.pol.cancel != nil {
		l.pol.cancel()
	}
}
