package wire

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Broadcast: one operation to every live rank, settled by their acks.

// op is one broadcast waiting for its acks.
type op struct {
	waiting []bool // by rank
	left    int
	errs    []error // by rank
	dead    []int   // ranks that died while it was in flight
	suspect []int   // ranks that fell silent while it was in flight
	done    chan struct{}
}

func (o *op) settle(rank int, err error) {
	if !o.waiting[rank] {
		return
	}
	o.waiting[rank] = false
	o.errs[rank] = err
	o.left--
	if o.left == 0 {
		close(o.done)
	}
}

// Broadcast sends an encoded plan.Step to every rank and returns when every
// rank acked it: nil if all executed it, else an error naming each rank that
// failed (a *DeadRanksError wrapping ErrRankDead for ranks that died in
// flight). With a dead rank it returns a *DeadRanksError at once, sending
// nothing. ctx bounds the wait; on expiry the error names the ranks that had
// not answered.
func (l *Coordinator) Broadcast(ctx context.Context, step []byte) error {
	l.mu.Lock()
	switch {
	case l.closedErr != nil:
		l.mu.Unlock()
		return ErrClosed
	case l.hs == nil:
		l.mu.Unlock()
		return fmt.Errorf("%w: cannot broadcast", ErrNotReady)
	}
	if dead := l.deadLocked(); len(dead) > 0 {
		l.mu.Unlock()
		return &DeadRanksError{Ranks: dead}
	}
	if sus := l.suspectedLocked(); len(sus) > 0 {
		l.mu.Unlock()
		return &SuspectRanksError{Ranks: sus}
	}
	id := l.nextID.Add(1)
	n := len(l.ranks)
	o := &op{waiting: make([]bool, n), left: n, errs: make([]error, n), done: make(chan struct{})}
	for r := range o.waiting {
		o.waiting[r] = true
	}
	l.ops[id] = o
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.ops, id)
		l.mu.Unlock()
	}()

	if err := l.t.broadcast(encodeLeader(id, fnStep, step)); err != nil {
		if errors.Is(err, errTransportClosed) {
			return ErrClosed
		}
		return fmt.Errorf("wire: broadcast %d: send: %w", id, err)
	}
	select {
	case <-o.done:
	case <-l.closed:
		return ErrClosed
	case <-ctx.Done():
		l.mu.Lock()
		var pending []int
		for r, w := range o.waiting {
			if w {
				pending = append(pending, r)
			}
		}
		l.mu.Unlock()
		return fmt.Errorf("wire: broadcast %d: rank(s) %v did not answer: %w", id, pending, ctx.Err())
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []error
	if len(o.dead) > 0 {
		slices.Sort(o.dead)
		errs = append(errs, &DeadRanksError{Ranks: o.dead, During: true})
	}
	if len(o.suspect) > 0 {
		slices.Sort(o.suspect)
		errs = append(errs, &SuspectRanksError{Ranks: o.suspect, During: true})
	}
	for _, e := range o.errs {
		if e != nil {
			errs = append(errs, e)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("wire: broadcast %d: %w", id, errors.Join(errs...))
	}
	return nil
}
