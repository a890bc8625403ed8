package policy

import (
	"fmt"
	"math"
	"time"

	"golang.org/x/time/rate"
)

// Admit is an admission mode (DYN_KVBM_DISK_ADMISSION,
// DYN_KVBM_OBJECT_ADMISSION).
type Admit int

const (
	// AdmitAll lets every candidate through (budgets still apply).
	AdmitAll Admit = iota
	// AdmitFrequency: the leader's own frequency filter decided (G3 only).
	AdmitFrequency
	// AdmitSketch: the block's Sketch estimate must reach MinCount.
	AdmitSketch
)

// ParseAdmit maps config's admission names to modes.
func ParseAdmit(s string) (Admit, error) {
	switch s {
	case "all":
		return AdmitAll, nil
	case "frequency":
		return AdmitFrequency, nil
	case "sketch":
		return AdmitSketch, nil
	}
	return 0, fmt.Errorf("policy: unknown admission %q (all, frequency, sketch)", s)
}

// MinCount is how many sightings the sketch needs before a block is written
// to a slower tier; HotCount marks a block valuable enough to spend the
// last half of a budget on.
const (
	MinCount = 2
	HotCount = 4
)

// Why a candidate write was not made.
const (
	RejectCold   = "cold"   // the sketch has not seen it often enough
	RejectBudget = "budget" // the tier's write budget is spent
)

// Gate is one slower tier's admission: its mode and its budget. Not safe
// for concurrent use (the leader's lock).
type Gate struct {
	mode  Admit
	lim   *rate.Limiter // nil: no budget
	burst float64
	now   func() time.Time
}

// NewGate creates a gate. perSecond > 0 is a budget in writes (blocks for
// G3, PUTs for G4) per second, with a burst of one second's worth; 0 means
// none. now is the clock (nil: time.Now).
func NewGate(mode Admit, perSecond float64, now func() time.Time) (*Gate, error) {
	if perSecond < 0 || math.IsNaN(perSecond) || math.IsInf(perSecond, 0) {
		return nil, fmt.Errorf("policy: write budget %v per second: want a finite number ≥ 0", perSecond)
	}
	if now == nil {
		now = time.Now
	}
	g := &Gate{mode: mode, now: now}
	if perSecond > 0 {
		burst := max(1, int(math.Ceil(perSecond)))
		g.lim = rate.NewLimiter(rate.Limit(perSecond), burst)
		g.burst = float64(burst)
	}
	return g, nil
}

// Mode is the gate's admission mode.
func (g *Gate) Mode() Admit { return g.mode }

// Admit decides one write of a block whose sketch estimate is count (pass
// MinCount when no sketch counts for this tier). Cold blocks are refused
// under AdmitSketch. With a budget, the first half of the bucket serves
// every admitted block and the last half only hot ones (count ≥
// HotCount), so when writes outrun the budget the least valuable are
// dropped first. reason is RejectCold or RejectBudget when refused.
func (g *Gate) Admit(count int) (ok bool, reason string) {
	if g.mode == AdmitSketch && count < MinCount {
		return false, RejectCold
	}
	if g.lim == nil {
		return true, ""
	}
	now := g.now()
	if count < HotCount && g.lim.TokensAt(now)-1 < g.burst/2 {
		return false, RejectBudget
	}
	if !g.lim.AllowN(now, 1) {
		return false, RejectBudget
	}
	return true, ""
}
