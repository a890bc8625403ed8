package wire

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvbm/kvbm/goext/config"
)

// Liveness: heartbeats, suspected ranks (silent, re-admitted when they
// answer) and dead ones (their process is gone).

// heartbeat pings every PingInterval, suspects ranks silent for
// SuspectAfter and marks dead those whose process is gone. It stops when
// every rank is dead. Pings keep going to suspected ranks: a stopped
// process finds them queued when it resumes and its answer re-admits it
// (a handful of small messages per second fills no socket buffer).
func (l *Coordinator) heartbeat() {
	defer l.wg.Done()
	tick := time.NewTicker(l.opts.PingInterval)
	defer tick.Stop()
	for {
		select {
		case <-l.closed:
			return
		case <-tick.C:
		}
		if err := l.t.broadcast(encodeLeader(l.nextID.Add(1), fnPing, nil)); err != nil && !errors.Is(err, errTransportClosed) {
			l.log.Debug("kvbm leader side channel: ping send", "err", err)
		}
		now := time.Now()
		l.mu.Lock()
		alive := 0
		for r := range l.ranks {
			rs := &l.ranks[r]
			switch {
			case rs.dead:
				continue
			case rs.md != nil && processGone(rs.md.Pid, rs.md.PidNS):
				l.markDeadLocked(r, fmt.Sprintf("process %d exited", rs.md.Pid))
				continue
			case !rs.suspect && now.Sub(rs.lastSeen) > l.opts.SuspectAfter:
				l.suspectLocked(r, now.Sub(rs.lastSeen))
			}
			alive++
		}
		l.mu.Unlock()
		if alive == 0 {
			return
		}
	}
}

// suspectLocked stops planning for a silent rank; operations waiting on it
// fail with a *SuspectRanksError.
func (l *Coordinator) suspectLocked(rank int, silent time.Duration) {
	rs := &l.ranks[rank]
	rs.suspect = true
	l.log.Warn("kvbm worker rank not answering; suspected: no transfers are planned for it until it answers again "+
		"(the engine keeps serving)", "rank", rank, "pid", rs.pid(), "silent", silent.Round(time.Millisecond),
		"timeout", l.opts.SuspectAfter, "variable", config.EnvLeaderWorkerLivenessSecs)
	for _, o := range l.ops {
		if o.waiting[rank] {
			o.suspect = append(o.suspect, rank)
			o.settle(rank, nil)
		}
	}
}

func (rs *rankState) pid() int {
	if rs.md == nil {
		return 0
	}
	return rs.md.Pid
}

func (l *Coordinator) markDeadLocked(rank int, why string) {
	l.markRankLocked(rank, why, false)
}

// markGoneLocked is markDeadLocked for a worker that said goodbye: the same
// consequences, logged as a departure rather than a failure.
func (l *Coordinator) markGoneLocked(rank int, why string) {
	l.markRankLocked(rank, why, true)
}

func (l *Coordinator) markRankLocked(rank int, why string, left bool) {
	rs := &l.ranks[rank]
	if rs.dead {
		return
	}
	rs.dead = true
	if left {
		l.log.Info("kvbm worker rank closed; no more transfers are planned for it", "rank", rank, "pid", rs.pid(), "why", why)
	} else {
		l.log.Error("kvbm worker rank is gone; marked dead: transfers that need it are no longer planned, "+
			"the engine keeps serving (misses recompute)", "rank", rank, "pid", rs.pid(), "why", why)
	}
	for _, o := range l.ops {
		if o.waiting[rank] {
			o.dead = append(o.dead, rank)
			o.settle(rank, nil)
		}
	}
}

// SuspectRanks lists the ranks suspected (silent, not known dead), in order.
func (l *Coordinator) SuspectRanks() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.suspectedLocked()
}

func (l *Coordinator) suspectedLocked() []int {
	var d []int
	for r, rs := range l.ranks {
		if rs.suspect && !rs.dead {
			d = append(d, r)
		}
	}
	return d
}

// DeadRanks lists the ranks marked dead, in order.
func (l *Coordinator) DeadRanks() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deadLocked()
}

func (l *Coordinator) deadLocked() []int {
	var d []int
	for r, rs := range l.ranks {
		if rs.dead {
			d = append(d, r)
		}
	}
	return d
}

// Healthy reports whether the handshake completed and every rank is
// answering: whether operations can be planned now.
func (l *Coordinator) Healthy() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.hs != nil && l.closedErr == nil && len(l.deadLocked()) == 0 && len(l.suspectedLocked()) == 0
}
