package leader

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Requests the engine never reports finished.
//
// Every call about a request (match, allocation, step update, finished load)
// moves its slot to the newest end of a list ordered by that time; each Step
// forgets, from the oldest end, the slots idle for longer than
// config.LeaderRequestIdle, as RequestFinished would (staged pins released,
// lookup state dropped), and counts them (kvbm_requests_aged_out). Each call
// costs O(1) and a Step O(slots aged out). A slot whose load is with the
// workers is kept: only the workers' report may release its sources.
//
// A forgotten request that comes back is a new request to the leader: a
// match stages from scratch, an allocation without a match plans nothing,
// and a step update that continues it (tokens appended, not its whole token
// list) leaves it without offload, since the blocks' hashes need the tokens
// the leader no longer has (applyUpdate).

// idleList links the live slots, least recently touched first.
type idleList struct {
	oldest, newest *slot
	timeout        time.Duration // 0: slots never age out
	agedOut        prometheus.Counter
}

// touch marks s used at now: it moves to the newest end. l.mu held.
func (l *Leader) touch(s *slot, now time.Time) {
	if l.idle.timeout <= 0 {
		return
	}
	s.touched = now
	if l.idle.newest == s {
		return
	}
	l.unlinkIdle(s)
	s.older = l.idle.newest
	if s.older != nil {
		s.older.newer = s
	} else {
		l.idle.oldest = s
	}
	l.idle.newest = s
	s.linked = true
}

// unlinkIdle takes s off the list (it is being forgotten). l.mu held.
func (l *Leader) unlinkIdle(s *slot) {
	if !s.linked {
		return
	}
	if s.older != nil {
		s.older.newer = s.newer
	} else {
		l.idle.oldest = s.newer
	}
	if s.newer != nil {
		s.newer.older = s.older
	} else {
		l.idle.newest = s.older
	}
	s.older, s.newer, s.linked = nil, nil, false
}

// ageOut forgets the slots idle for longer than the timeout at now. l.mu
// held.
func (l *Leader) ageOut(now time.Time) {
	if l.idle.timeout <= 0 {
		return
	}
	cutoff := now.Add(-l.idle.timeout)
	for s := l.idle.oldest; s != nil && s.touched.Before(cutoff); s = l.idle.oldest {
		if s.load == loadEmitted {
			// Its load is with the workers; LoadsFinished releases it.
			l.touch(s, now)
			continue
		}
		l.log.Debug("kvbm: request idle too long; forgetting it (never reported finished)",
			"request", s.id, "idle", now.Sub(s.touched).String())
		l.forget(s)
		l.idle.agedOut.Inc()
	}
}
