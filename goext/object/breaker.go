package object

import (
	"sync"
	"time"
)

// breaker is a circuit breaker: after threshold consecutive failures it
// opens, and every request is refused at once (no network, no waiting)
// until cooldown passed; then one request at a time is let through, and the
// first success closes it again.
type breaker struct {
	threshold int
	cooldown  time.Duration
	now       func() time.Time

	mu       sync.Mutex // guards the fields below
	fails    int
	openTill time.Time // zero: closed
	probing  bool      // a request is testing a half-open breaker
}

func newBreaker(threshold int, cooldown time.Duration, now func() time.Time) *breaker {
	return &breaker{threshold: max(threshold, 1), cooldown: cooldown, now: now}
}

// allow reports whether a request may go out now. A true answer must be
// followed by done.
func (b *breaker) allow() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.openTill.IsZero() {
		return true
	}
	if b.probing || b.now().Before(b.openTill) {
		return false
	}
	b.probing = true
	return true
}

// done records a request's outcome; it reports whether the breaker changed
// state (opened or closed), for a log line.
func (b *breaker) done(ok bool) (opened, closed bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	wasOpen := !b.openTill.IsZero()
	b.probing = false
	if ok {
		b.fails = 0
		b.openTill = time.Time{}
		return false, wasOpen
	}
	b.fails++
	if wasOpen || b.fails >= b.threshold {
		b.openTill = b.now().Add(b.cooldown)
		return !wasOpen, false
	}
	return false, false
}

func (b *breaker) isOpen() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.openTill.IsZero()
}

// abandon ends a request let through by allow without a verdict (the
// caller gave up), so that another may test the store.
func (b *breaker) abandon() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing = false
}

// refusing reports whether allow would refuse now (open and cooling down, or
// a test request already out), without taking the test slot.
func (b *breaker) refusing() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.openTill.IsZero() && (b.probing || b.now().Before(b.openTill))
}
