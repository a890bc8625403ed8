package policy

import (
	"math"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
)

// linear is an exponentially decayed least-squares fit of y = a + b·x with
// a prior: two pseudo-points on the prior line (x = 0 and x = xRef) whose
// weight does not decay, so the fit starts at the prior, moves to the
// measurements as they come, and stays defined when every measurement has
// the same x.
type linear struct {
	w, sx, sy, sxx, sxy float64 // decayed measurements
	p                   [5]float64
	n                   uint64 // measurements seen
}

func newLinear(a, b, xRef, weight float64) linear {
	var l linear
	for _, x := range []float64{0, xRef} {
		y := a + b*x
		w := weight / 2
		l.p[0] += w
		l.p[1] += w * x
		l.p[2] += w * y
		l.p[3] += w * x * x
		l.p[4] += w * x * y
	}
	return l
}

// observe adds (x, y) after decaying the earlier measurements by decay.
func (l *linear) observe(x, y, decay float64) {
	l.w = l.w*decay + 1
	l.sx = l.sx*decay + x
	l.sy = l.sy*decay + y
	l.sxx = l.sxx*decay + x*x
	l.sxy = l.sxy*decay + x*y
	l.n++
}

// fit returns the line, both coefficients clamped at zero (a load never
// takes negative time, nor gets faster with more bytes).
func (l *linear) fit() (a, b float64) {
	w, sx, sy := l.w+l.p[0], l.sx+l.p[1], l.sy+l.p[2]
	sxx, sxy := l.sxx+l.p[3], l.sxy+l.p[4]
	if den := w*sxx - sx*sx; den > 1e-12*w*sxx {
		b = (w*sxy - sx*sy) / den
		a = (sy - b*sx) / w
	} else {
		a = sy / w
	}
	switch {
	case b < 0: // flat: the mean
		b, a = 0, sy/w
	case a < 0: // through the origin
		a = 0
		if sxx > 0 {
			b = max(sxy/sxx, 0)
		}
	}
	return a, b
}

// Priors: what a tier is assumed to cost before it was measured (one
// rank's share of a block). Deliberately middle-of-the-road: the first
// measurements replace them within a few requests.
var (
	// G2 → G1: pinned host memory over PCIe.
	priorG2 = TierCost{Latency: 20 * time.Microsecond, SecondsPerMB: 1 / 10e3}
	// G3 → G1: an NVMe read (O_DIRECT) and the host hop.
	priorG3 = TierCost{Latency: 200 * time.Microsecond, SecondsPerMB: 1 / 2e3}
	// G4 → G2: an object GET over a data-centre network.
	priorG4 = TierCost{Latency: 20 * time.Millisecond, SecondsPerMB: 1 / 500.0}
	// One prompt token: a mid-sized model on one GPU computes tens of
	// thousands of prompt tokens a second.
	priorPrefillPerToken = 50 * time.Microsecond
	priorStepOverhead    = 5 * time.Millisecond
)

const (
	// decayPerObservation: each measurement weighs this much less at the
	// next one (half-life about 14 measurements), so the estimates follow a
	// tier that slows down within a few dozen transfers.
	decayPerObservation = 0.95
	// priorWeight: the prior counts as this many measurements, forever; at
	// steady state (1/(1-decay) = 20 measurements) it is 1% of the fit.
	priorWeight = 0.2
	refMB       = 4.0 // the prior's second point: a few blocks' worth
	refTokens   = 256 // the prefill prior's second point: a short prompt (a far point would weigh like many)
	// stepClip: a step timing above this many times the current estimate
	// (plus stepClipFloor) is clipped there: the gap before the first step
	// after an idle period is not a step's cost.
	stepClip      = 3.0
	stepClipFloor = 0.05 // seconds
	// MinStepTokens: steps that scheduled fewer tokens (decode steps) are
	// not measured. They say little about prefill, and they are the steps
	// an idle period follows (the last decode of a burst), whose "duration"
	// would be the idle time.
	MinStepTokens = 64
	// ExploreFirst, ExploreEvery: a tier the cost policy skipped since it
	// was last measured is loaded once more (Decide) after ExploreFirst
	// skips, then after twice as many at each exploration that did not make
	// it worth loading again, up to ExploreEvery: so that its estimate
	// follows a tier that got faster again, and one stalled measurement
	// (a cold connection, a busy host) does not keep a tier off for long.
	ExploreFirst = 4
	ExploreEvery = 50
	// recentN: the lower bounds a loading request has seen (end-to-end
	// waits, G4 lookup round trips) are the least of the last recentN
	// measurements: a bound follows a tier that got slower within recentN
	// loads, and one stalled measurement does not raise it.
	recentN = 4
)

// recentMin keeps the last recentN measurements and answers their least.
type recentMin struct {
	v [recentN]float64
	n uint64 // measurements seen
}

func (r *recentMin) observe(x float64) {
	r.v[r.n%recentN] = x
	r.n++
}

// min is the least of the last recentN measurements (ok false: none yet).
func (r *recentMin) min() (float64, bool) {
	if r.n == 0 {
		return 0, false
	}
	out := math.Inf(1)
	for k := range min(r.n, recentN) {
		out = math.Min(out, r.v[k])
	}
	return out, true
}

// TierCost is one tier's expected load cost: Latency + MB × SecondsPerMB
// for a load of MB megabytes (one rank's share).
type TierCost struct {
	Latency      time.Duration
	SecondsPerMB float64
}

// Seconds is the expected time of a load of mb megabytes (0 for nothing).
func (c TierCost) Seconds(mb float64) float64 {
	if mb <= 0 {
		return 0
	}
	return c.Latency.Seconds() + mb*c.SecondsPerMB
}

// Estimates is a snapshot of a Model.
type Estimates struct {
	Tier map[plan.Tier]TierCost
	// Measured counts the measurements behind each tier's estimate.
	Measured map[plan.Tier]uint64
	// PrefillPerToken is what one prompt token costs to compute;
	// PrefillConfigured is true when it is DYN_KVBM_PREFILL_US_PER_TOKEN
	// rather than measured.
	PrefillPerToken   time.Duration
	PrefillConfigured bool
	StepsMeasured     uint64
}

// Model keeps the online estimates. Safe for concurrent use.
type Model struct {
	mu      sync.Mutex
	tiers   [3]linear // G2, G3, G4: x = MB (one rank's share), y = seconds
	prefill linear    // x = tokens scheduled in a step, y = its seconds
	fixed   float64   // configured seconds per token; 0: measured
	skips   [3]int    // Cost decisions that skipped the tier since its last measurement
	// explored: explorations of the tier since a Cost decision last loaded
	// it on its estimate (the next comes after ExploreFirst << explored skips).
	explored [3]int
	direct   [3]bool // the tier was measured by a worker's timed batch (ObserveTransfer)

	lastStep   time.Time
	lastTokens int

	// rtt: seconds of one wave of G4 lookup requests (a lookup's time over
	// the waves of HEAD requests it issued, LookupWaves), the least of the
	// recent ones (none: no lookup cost is assumed).
	rtt recentMin

	// e2e: per tier (G3, G4; G2 unused), what loading requests waited
	// beyond the tier's own estimate of their load: seconds from the load
	// decision until the engine step after the load was reported finished
	// (step waits and per-request overhead included) minus the tier
	// model's time for the load's MB, the least of the recent ones.
	e2e [3]recentMin

	// g4WaveMB: MB one wave of G4 downloads moves (Shape.DownloadWave); 0:
	// one wave per load.
	g4WaveMB float64
}

// NewModel starts a model at the priors. prefillUsPerToken > 0 fixes the
// prefill cost (DYN_KVBM_PREFILL_US_PER_TOKEN); 0 measures it.
func NewModel(prefillUsPerToken float64) *Model {
	m := &Model{fixed: prefillUsPerToken * 1e-6}
	for i, c := range []TierCost{priorG2, priorG3, priorG4} {
		m.tiers[i] = newLinear(c.Latency.Seconds(), c.SecondsPerMB, refMB, priorWeight)
	}
	m.prefill = newLinear(priorStepOverhead.Seconds(), priorPrefillPerToken.Seconds(), refTokens, priorWeight)
	return m
}

func tierIndex(t plan.Tier) (int, bool) {
	switch t {
	case plan.G2:
		return 0, true
	case plan.G3:
		return 1, true
	case plan.G4:
		return 2, true
	}
	return 0, false
}

// ObserveLoad records one timed load of bytes (one rank's share) from tier
// t that took d. Latency-only measurements (a G4 HEAD request) pass 0 bytes.
func (m *Model) ObserveLoad(t plan.Tier, bytes int64, d time.Duration) {
	i, ok := tierIndex(t)
	if !ok || bytes < 0 || d < 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.observeTierLocked(i, float64(bytes)/1e6, d.Seconds())
}

// observeTierLocked adds one load of mb that took secs to tier i's fit. A
// G4 load's downloads run in waves (Shape.DownloadWave), each paying the
// request latency: the fit is per wave (y/w = a + b·x/w), so that
// Latency is one request's and a load of w waves costs w·Latency + b·x.
func (m *Model) observeTierLocked(i int, mb, secs float64) {
	if w := m.g4WavesLocked(i, mb); w > 1 {
		mb, secs = mb/float64(w), secs/float64(w)
	}
	m.tiers[i].observe(mb, secs, decayPerObservation)
	m.skips[i] = 0
}

// g4WavesLocked is how many waves of downloads a G4 load of mb takes (1
// for the other tiers, and without a wave size).
func (m *Model) g4WavesLocked(i int, mb float64) int {
	if i != 2 || m.g4WaveMB <= 0 || mb <= 0 {
		return 1
	}
	return max(int(math.Ceil(mb/m.g4WaveMB-1e-9)), 1)
}

// SetDownloadWave tells the model how G4 downloads are issued: waves of at
// most blocks downloads of mbPerBlock each (the worker's bound on
// downloads in flight); 0 blocks: one wave per load.
func (m *Model) SetDownloadWave(blocks int, mbPerBlock float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.g4WaveMB = max(float64(blocks)*mbPerBlock, 0)
}

// ObserveLoadWait records what the leader saw of one load from tier t
// (G3 or G4): bytes (one rank's share) that took d from the step that
// planned them to the step that learnt they were done, the other tiers'
// share of the load taken out. It includes up to one engine step of
// waiting for the report, so it only counts for a tier that no worker of
// this process measures directly.
func (m *Model) ObserveLoadWait(t plan.Tier, bytes int64, d time.Duration) {
	i, ok := tierIndex(t)
	if !ok || t == plan.G2 || bytes <= 0 || d < 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.direct[i] {
		return
	}
	m.observeTierLocked(i, float64(bytes)/1e6, d.Seconds())
}

// ObserveEndToEnd records what one loading request waited for a load of
// bytes (one rank's share, every tier's blocks) whose deepest tier is t
// (G3 or G4): d from the load decision until the engine step after the
// load was reported finished, the step the request computes in. It
// includes every step the request waited while its load was in flight and
// any per-request overhead the tier model does not see; Decide never
// expects a load whose deepest tier is t to take less.
func (m *Model) ObserveEndToEnd(t plan.Tier, bytes int64, d time.Duration) {
	i, ok := tierIndex(t)
	if !ok || t == plan.G2 || bytes <= 0 || d < 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	mb := float64(bytes) / 1e6
	m.e2e[i].observe(d.Seconds() - m.tierLocked(i).Seconds(mb))
}

// EndToEnd is the expected end-to-end wait of a load of mb whose deepest
// tier is t, and whether any was measured.
func (m *Model) EndToEnd(t plan.Tier, mb float64) (float64, bool) {
	i, ok := tierIndex(t)
	if !ok {
		return 0, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.e2eLocked(i, mb)
}

func (m *Model) e2eLocked(i int, mb float64) (float64, bool) {
	extra, ok := m.e2e[i].min()
	if !ok {
		return 0, false
	}
	return m.tierLocked(i).Seconds(mb) + extra, true
}

// LookupWaves is how many successive waves of HEAD requests a G4 lookup of
// n blocks nobody registered issues when every one of them is stored (the
// best case for loading): object.Store.LookupSalted asks for the first
// block alone, then for the other n-1 at most concurrency at a time
// (concurrency <= 0: all at once). A lookup whose first block is missing
// stops after one wave.
func LookupWaves(n, concurrency int) int {
	if n <= 0 {
		return 0
	}
	if concurrency <= 0 || n == 1 {
		return min(n, 2)
	}
	return 1 + (n-1+concurrency-1)/concurrency
}

// ObserveLookup records one G4 lookup that asked the bucket in waves
// successive waves of requests (LookupWaves, or 1 when its first block was
// missing) and took d. A request whose blocks the registry does not know
// pays it before any load can start, so a lookup that cannot pay for
// itself is not started (Shape.Overhead, LookupSeconds).
func (m *Model) ObserveLookup(d time.Duration, waves int) {
	if d < 0 || waves <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.rtt.observe(d.Seconds() / float64(waves))
}

// LookupSeconds is the expected time of a G4 lookup of n blocks that are
// all stored, issued concurrency HEAD requests at a time (LookupWaves); 0
// before the first lookup was measured.
func (m *Model) LookupSeconds(n, concurrency int) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	rtt, _ := m.rtt.min()
	return rtt * float64(LookupWaves(n, concurrency))
}

// ObserveStep records that the engine began a step at now scheduling tokens
// tokens; the time since the previous step measures that one.
func (m *Model) ObserveStep(now time.Time, tokens int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	prev, prevTokens := m.lastStep, m.lastTokens
	m.lastStep, m.lastTokens = now, tokens
	if prev.IsZero() || prevTokens < MinStepTokens || m.fixed > 0 {
		return
	}
	dt := now.Sub(prev).Seconds()
	if dt <= 0 {
		return
	}
	a, b := m.prefill.fit()
	x := float64(prevTokens)
	dt = min(dt, stepClip*(a+b*x)+stepClipFloor)
	m.prefill.observe(x, dt, decayPerObservation)
}

// Tier returns tier t's current estimate.
func (m *Model) Tier(t plan.Tier) TierCost {
	i, ok := tierIndex(t)
	if !ok {
		return TierCost{}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tierLocked(i)
}

func (m *Model) tierLocked(i int) TierCost {
	a, b := m.tiers[i].fit()
	return TierCost{Latency: seconds(a), SecondsPerMB: b}
}

// PrefillPerToken is the expected cost of computing one more prompt token.
func (m *Model) PrefillPerToken() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	return seconds(m.prefillLocked())
}

func (m *Model) prefillLocked() float64 {
	if m.fixed > 0 {
		return m.fixed
	}
	_, b := m.prefill.fit()
	return b
}

// Snapshot returns every estimate.
func (m *Model) Snapshot() Estimates {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := Estimates{Tier: map[plan.Tier]TierCost{}, Measured: map[plan.Tier]uint64{},
		PrefillPerToken: seconds(m.prefillLocked()), PrefillConfigured: m.fixed > 0, StepsMeasured: m.prefill.n}
	for i, t := range []plan.Tier{plan.G2, plan.G3, plan.G4} {
		e.Tier[t] = m.tierLocked(i)
		e.Measured[t] = m.tiers[i].n
	}
	return e
}

func seconds(s float64) time.Duration {
	if s >= math.MaxInt64/1e9 {
		return math.MaxInt64
	}
	return time.Duration(s * 1e9)
}
