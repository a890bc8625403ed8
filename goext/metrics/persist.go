package metrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// RecordG3Recovery publishes what a persistent disk tier recovered at start
// (docs/persistent-g3.md): blocks registered again, blocks discarded by
// reason, and the time taken. The gauges are registered on first use, so a
// process without a persistent tier exports none of them.
func (m *Metrics) RecordG3Recovery(recovered int, discarded map[string]int, seconds float64) {
	rec := register(m.Registry, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvbm_g3_recovered_blocks", Help: "Disk tier blocks recovered from a persistent tier file at start",
	}))
	dis := register(m.Registry, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvbm_g3_recovery_discarded_blocks",
		Help: "Disk tier blocks found at start but not recovered, by reason",
	}, []string{"reason"}))
	secs := register(m.Registry, prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvbm_g3_recovery_seconds", Help: "Time taken to recover the persistent disk tier at start",
	}))
	rec.Set(float64(recovered))
	for reason, n := range discarded {
		dis.WithLabelValues(reason).Set(float64(n))
	}
	secs.Set(seconds)
}

// register registers c, or returns the collector already registered under
// its name.
func register[C prometheus.Collector](r *prometheus.Registry, c C) C {
	if err := r.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
	}
	return c
}

// G3LoadUnauthenticated counts the recovered disk tier blocks whose payload
// did not verify against the MAC in their header when loaded: not served,
// the load fails (the engine recomputes) and the block is freed. Registered
// on first use (by a worker with a persistent tier).
func (m *Metrics) G3LoadUnauthenticated() prometheus.Counter {
	return register(m.Registry, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvbm_g3_load_unauthenticated_blocks",
		Help: "Recovered disk tier blocks whose payload did not verify against their MAC at load (not served, freed)",
	}))
}
