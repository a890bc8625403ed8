package metrics

import "github.com/prometheus/client_golang/prometheus"

// RequestsAgedOut counts the requests a leader forgot because it heard
// nothing about them for DYN_KVBM_LEADER_REQUEST_IDLE_TIMEOUT_SECS (the
// engine never reported them finished). Registered on first use.
func (m *Metrics) RequestsAgedOut() prometheus.Counter {
	return register(m.Registry, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvbm_requests_aged_out",
		Help: "Requests forgotten by the leader after no call about them for the idle timeout (never reported finished)",
	}))
}
