package events

import "sync"

// Buffer is a Sink that keeps kvbm's tier events until a reader drains
// them: the vLLM adapter publishes them in the engine's own KV event stream
// (its connector's take_events). It is bounded: beyond its limit new events
// are dropped and counted, so a reader that stopped draining costs a bounded
// amount of memory. Safe for concurrent use.
type Buffer struct {
	mu      sync.Mutex
	evs     []BlockEvent
	limit   int
	dropped uint64
}

// DefaultBufferLimit bounds a Buffer's events when NewBuffer is given no
// positive limit: many engine steps of a busy instance.
const DefaultBufferLimit = 1 << 20

// NewBuffer returns an empty buffer holding at most limit events
// (DefaultBufferLimit when limit <= 0).
func NewBuffer(limit int) *Buffer {
	if limit <= 0 {
		limit = DefaultBufferLimit
	}
	return &Buffer{limit: limit}
}

// Publish implements Sink.
func (b *Buffer) Publish(ev BlockEvent) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.evs) >= b.limit {
		b.dropped++
		return
	}
	b.evs = append(b.evs, ev)
}

// Drain returns the buffered events, oldest first, and empties the buffer.
func (b *Buffer) Drain() []BlockEvent {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.evs
	b.evs = nil
	return out
}

// Dropped is the number of events dropped at the limit (monotonic).
func (b *Buffer) Dropped() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.dropped
}

// Tee is a Sink that publishes every event to each of its sinks, in order.
type Tee []Sink

// Publish implements Sink.
func (t Tee) Publish(ev BlockEvent) {
	for _, s := range t {
		s.Publish(ev)
	}
}
