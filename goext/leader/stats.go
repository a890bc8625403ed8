package leader

import (
	"fmt"
	"time"
)

// requestHits is one finished request's matching outcome, in blocks.
type requestHits struct {
	queried, host, disk int
}

// hitWindow keeps the hit counts of the last n finished requests with running
// sums, so the rates cost O(1) per request (design §9: blocks matched in a tier /
// blocks queried, over the last DYN_KVBM_CACHE_STATS_MAX_REQUESTS requests).
type hitWindow struct {
	ring                []requestHits
	next                int
	full                bool
	queried, host, disk int
	changed             bool // a request was added since the last log line
}

func newHitWindow(n int) *hitWindow {
	if n < 1 {
		n = 1
	}
	return &hitWindow{ring: make([]requestHits, n)}
}

func (w *hitWindow) add(r requestHits) {
	old := w.ring[w.next]
	if w.full {
		w.queried -= old.queried
		w.host -= old.host
		w.disk -= old.disk
	}
	w.ring[w.next] = r
	w.queried += r.queried
	w.host += r.host
	w.disk += r.disk
	w.next++
	if w.next == len(w.ring) {
		w.next = 0
		w.full = true
	}
	w.changed = true
}

// rates returns the host and disk hit rates in 0..1 (0 when nothing was queried).
func (w *hitWindow) rates() (host, disk float64) {
	if w.queried == 0 {
		return 0, 0
	}
	return float64(w.host) / float64(w.queried), float64(w.disk) / float64(w.queried)
}

// logLine is the reference's periodic cache line, byte for byte (operators
// grep it).
func (w *hitWindow) logLine(workerID uint64) string {
	h, d := w.rates()
	return fmt.Sprintf("KVBM [worker-%d] Cache Hit Rates - Host: %.1f%% (%d/%d), Disk: %.1f%% (%d/%d)",
		workerID, h*100, w.host, w.queried, d*100, w.disk, w.queried)
}

// statsLogger decides when the periodic line is due: every interval, and only
// when a request finished since the previous line (an idle engine stays quiet).
type statsLogger struct {
	interval time.Duration
	last     time.Time
}

func (s *statsLogger) due(now time.Time, w *hitWindow) bool {
	if s.interval <= 0 || !w.changed || now.Sub(s.last) < s.interval {
		return false
	}
	s.last = now
	w.changed = false
	return true
}
