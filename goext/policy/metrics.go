package policy

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbm/kvbm/goext/plan"
)

// Metrics are the decisions' counters and the model's estimates.
type Metrics struct {
	// SkippedTokens: matched tokens the load policy left to the engine,
	// by tier and reason (ReasonSlower, ReasonOverCap).
	SkippedTokens *prometheus.CounterVec
	// Admitted and Rejected: candidate writes to G3 ("g3") and G4
	// ("g4"); Rejected by reason (RejectCold, RejectBudget).
	Admitted *prometheus.CounterVec
	Rejected *prometheus.CounterVec
	// LookupsSkipped: requests whose G4 lookup the load policy did not
	// start, loading from G4 being expected to lose even if every block
	// were there.
	LookupsSkipped prometheus.Counter
}

// TierLabel is a tier's label value ("g2", "g3", "g4").
func TierLabel(t plan.Tier) string {
	switch t {
	case plan.G2:
		return "g2"
	case plan.G3:
		return "g3"
	case plan.G4:
		return "g4"
	}
	return "other"
}

// NewMetrics registers the counters, and gauges reading model, in r. A
// collector already registered there (a second leader on one registry) is
// shared.
func NewMetrics(r prometheus.Registerer, model *Model) *Metrics {
	m := &Metrics{
		SkippedTokens: register(r, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_load_policy_skipped_tokens",
			Help: "Matched tokens not loaded but recomputed by the engine, by tier and reason (DYN_KVBM_LOAD_POLICY)"},
			[]string{"tier", "reason"})),
		Admitted: register(r, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_admission_admitted_blocks",
			Help: "Blocks admitted for writing to a slower tier (g3: disk, g4: object store)"},
			[]string{"tier"})),
		Rejected: register(r, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbm_admission_rejected_blocks",
			Help: "Blocks not written to a slower tier, by reason (cold: not seen often enough; budget: write budget spent)"},
			[]string{"tier", "reason"})),
	}
	m.LookupsSkipped = register(r, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvbm_load_policy_g4_lookups_skipped",
		Help: "Requests not looked up in G4: loading from it was expected to lose even on a full hit (DYN_KVBM_LOAD_POLICY)"}))
	if model == nil {
		return m
	}
	for _, t := range Tiers {
		labels := prometheus.Labels{"tier": TierLabel(t)}
		register(r, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbm_load_cost_latency_seconds", Help: "Estimated fixed latency of one load from a tier",
			ConstLabels: labels}, func() float64 { return model.Tier(t).Latency.Seconds() }))
		register(r, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbm_load_cost_seconds_per_mb", Help: "Estimated seconds per MB (one rank's share) loaded from a tier",
			ConstLabels: labels}, func() float64 { return model.Tier(t).SecondsPerMB }))
	}
	register(r, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbm_prefill_seconds_per_token", Help: "Estimated (or configured) cost of computing one prompt token"},
		func() float64 { return model.PrefillPerToken().Seconds() }))
	return m
}

func register[C prometheus.Collector](r prometheus.Registerer, c C) C {
	if err := r.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if old, ok := are.ExistingCollector.(C); ok {
				return old
			}
		}
	}
	return c
}
