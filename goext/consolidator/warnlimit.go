package consolidator

import (
	"fmt"
	"log/slog"
	"time"
)

// Defaults of warnLimiter.
const (
	defaultWarnBurst  = 10
	defaultWarnPeriod = time.Minute
)

// warnLimiter rate-limits one stream of warnings caused by outside input,
// which a broken or hostile peer can make arbitrarily long (50,000 bad
// events were once 50,000 WARN lines). In each period the first burst
// warnings are logged in full; the rest are only counted, and one summary
// line reports the count when the period is over: at the first warning
// after it, or at Flush.
//
// It is not safe for concurrent use: each user owns its own (a subscriber
// goroutine, or the Tracker under the Consolidator's lock).
type warnLimiter struct {
	log    *slog.Logger
	what   string // names the stream in the summary
	burst  int
	period time.Duration
	now    func() time.Time // time.Now; tests step their own clock

	start      time.Time // of the current period
	logged     int       // warnings logged in full in the current period
	suppressed uint64    // warnings only counted in the current period
	total      uint64    // warnings only counted, ever
}

func newWarnLimiter(log *slog.Logger, what string) *warnLimiter {
	return &warnLimiter{log: log, what: what, burst: defaultWarnBurst, period: defaultWarnPeriod, now: time.Now}
}

// Warn logs msg, or counts it if this period's burst is spent.
func (l *warnLimiter) Warn(msg string) {
	if now := l.now(); now.Sub(l.start) >= l.period {
		l.Flush()
		l.start, l.logged = now, 0
	}
	if l.logged < l.burst {
		l.logged++
		l.log.Warn(msg)
		return
	}
	l.suppressed++
	l.total++
}

// Flush logs the summary of the warnings suppressed since the last one, if
// any.
func (l *warnLimiter) Flush() {
	if l.suppressed == 0 {
		return
	}
	l.log.Warn(fmt.Sprintf("Suppressed %d %s warning(s) in the last %s after the first %d (%d suppressed in all)",
		l.suppressed, l.what, l.now().Sub(l.start).Round(time.Second), l.burst, l.total),
		"suppressed", l.suppressed, "total_suppressed", l.total)
	l.suppressed = 0
}
