package consolidator

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
)

const (
	// natsChunk is how many RouterEvents are published between two
	// confirmations (a flush round trip).
	natsChunk = 256
	// natsFlushTimeout bounds one confirmation.
	natsFlushTimeout = 2 * time.Second
	// natsCloseGrace bounds how long Close keeps trying to deliver.
	natsCloseGrace = 2 * time.Second
)

// natsOut publishes RouterEvent JSON to NATS core with our own bounded
// buffer in front of the connection.
//
// Delivery: events stay in the buffer until the server has confirmed them
// (a PING/PONG flush after each chunk), so a connection that dies mid-chunk
// loses nothing: the chunk is sent again after the reconnect. That is
// at-least-once; a consumer that must not see a duplicate can drop an
// event_id it has already seen (event ids are assigned once, in order, and
// also make drops visible as gaps). nats.go's own reconnect buffer is
// disabled so that our buffer is the only one, bounded by event count and
// with every drop counted and logged.
//
// Goroutines: run (owned by natsOut, started by newNATSOut, stopped by
// close), plus nats.go's own, which end with nc.Close.
type natsOut struct {
	nc       *nats.Conn
	subject  string
	workerID uint64
	limit    int
	log      *slog.Logger
	m        *metrics.Metrics

	mu      sync.Mutex // guards the fields below until the blank line
	buf     [][]byte   // encoded RouterEvents, oldest first
	nextID  uint64     // event_id of the next event
	sent    uint64     // confirmed by the server
	dropped uint64     // total
	outage  uint64     // dropped since the last summary log

	wake chan struct{} // capacity 1: new events or a (re)connect
	done chan struct{}
	wg   sync.WaitGroup
}

func newNATSOut(cfg *Config, subject string, m *metrics.Metrics) (*natsOut, error) {
	o := &natsOut{
		subject:  subject,
		workerID: cfg.WorkerID,
		limit:    cfg.BufferLimit,
		log:      cfg.Logger,
		m:        m,
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
	}
	lo, hi := cfg.ReconnectMin, cfg.ReconnectMax
	opts := []nats.Option{
		nats.Name("kvbm-kv-event-consolidator"),
		// NATS down at start is not an error: keep running and connect
		// when it comes up (the reference fails here).
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.CustomReconnectDelay(func(attempts int) time.Duration {
			d := lo << min(attempts, 16)
			d = min(d, hi)
			return d/2 + rand.N(d/2+1) // jitter: workers restarted together spread out
		}),
		nats.ReconnectBufSize(-1),
		nats.ConnectHandler(func(nc *nats.Conn) {
			o.log.Info("KV event consolidator connected to NATS at " + nc.ConnectedUrlRedacted())
			o.signal()
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			o.log.Info("KV event consolidator reconnected to NATS at " + nc.ConnectedUrlRedacted())
			o.signal()
		}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				o.log.Warn(fmt.Sprintf("KV event consolidator lost NATS (%v); buffering up to %d events while reconnecting", err, o.limit))
			}
		}),
	}
	opts = append(opts, cfg.NATSOptions...)
	nc, err := nats.Connect(cfg.NATSURL, opts...)
	if err != nil {
		return nil, fmt.Errorf("consolidator: NATS %s (NATS_SERVER): %w", cfg.NATSURL, err)
	}
	if !nc.IsConnected() {
		o.log.Warn(fmt.Sprintf("KV event consolidator: NATS at %s is not reachable yet; buffering up to %d events and retrying", cfg.NATSURL, o.limit))
	}
	o.nc = nc
	o.log.Info("KV event consolidator publishing RouterEvents on NATS subject " + subject)
	o.wg.Add(1)
	go o.run()
	return o, nil
}

func (o *natsOut) signal() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// enqueue assigns event ids, encodes and buffers evs; events beyond the
// buffer limit are dropped (newest first, so that the router's view stays
// a consistent prefix), counted and logged.
func (o *natsOut) enqueue(evs []events.ConsolidatedEvent) {
	enc := make([][]byte, len(evs))
	o.mu.Lock()
	first := o.nextID
	o.nextID += uint64(len(evs))
	o.mu.Unlock()
	for i := range evs {
		re := events.NewRouterEvent(o.workerID, first+uint64(i), &evs[i])
		b, err := json.Marshal(re)
		if err != nil { // cannot happen: every kind has an encoding
			o.log.Error(fmt.Sprintf("Failed to convert consolidated event, skipping: %v", err))
			continue
		}
		enc[i] = b
	}
	o.mu.Lock()
	var drops uint64
	for i, b := range enc {
		if b == nil {
			continue
		}
		if len(o.buf) >= o.limit {
			if o.outage == 0 {
				o.log.Warn(fmt.Sprintf("KV event consolidator: NATS buffer full (%d events); dropping events from event_id %d until NATS catches up",
					o.limit, first+uint64(i)))
			}
			drops++
			o.outage++
			continue
		}
		o.buf = append(o.buf, b)
	}
	o.dropped += drops
	if drops > 0 && o.m != nil { // under the lock: Stats and the metric agree
		o.m.EventsDropped.Add(float64(drops))
	}
	o.mu.Unlock()
	o.signal()
}

// run is the sender goroutine: it delivers the buffer whenever it is woken
// (new events, a connect) and retries every ReconnectMin-ish second while
// events wait, in case a wake-up raced with a disconnect.
func (o *natsOut) run() {
	defer o.wg.Done()
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		select {
		case <-o.wake:
		case <-retry.C:
		case <-o.done:
			o.deliver(time.Now().Add(natsCloseGrace))
			return
		}
		o.deliver(time.Time{})
		if o.buffered() > 0 {
			retry.Reset(time.Second)
		}
	}
}

// deliver sends buffered events chunk by chunk, removing each chunk only
// once the server confirmed it. It returns when the buffer is empty, NATS
// is not connected, a send fails, or deadline (if set) passes.
func (o *natsOut) deliver(deadline time.Time) {
	for {
		if !deadline.IsZero() && time.Now().After(deadline) {
			return
		}
		o.mu.Lock()
		n := min(len(o.buf), natsChunk)
		chunk := o.buf[:n:n]
		o.mu.Unlock()
		if n == 0 || !o.nc.IsConnected() {
			return
		}
		for _, b := range chunk {
			if err := o.nc.Publish(o.subject, b); err != nil {
				o.log.Debug(fmt.Sprintf("NATS publish failed, will retry: %v", err))
				return
			}
		}
		if err := o.nc.FlushTimeout(natsFlushTimeout); err != nil {
			o.log.Debug(fmt.Sprintf("NATS flush failed, will resend %d event(s): %v", n, err))
			return
		}
		o.mu.Lock()
		clear(o.buf[:n]) // let the GC have the encoded events
		o.buf = o.buf[n:]
		o.sent += uint64(n)
		// Decided under the lock: an event enqueued right after the buffer
		// emptied must not swallow the summary of the outage before it.
		var summary uint64
		if len(o.buf) == 0 {
			summary, o.outage = o.outage, 0
		}
		queued := len(o.buf)
		o.mu.Unlock()
		if o.m != nil {
			o.m.EventsOut.Add(float64(n))
			o.m.EventQueue.Set(float64(queued))
		}
		if summary > 0 {
			o.log.Warn(fmt.Sprintf("KV event consolidator: NATS caught up; %d event(s) were dropped while it was unavailable (see event_id gaps)", summary))
		}
	}
}

func (o *natsOut) buffered() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.buf)
}

func (o *natsOut) counts() (sent, dropped uint64, buffered int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.sent, o.dropped, len(o.buf)
}

// close stops the sender (after a last delivery attempt bounded by
// natsCloseGrace) and closes the connection.
func (o *natsOut) close() {
	close(o.done)
	o.wg.Wait()
	if n := o.buffered(); n > 0 {
		o.log.Warn(fmt.Sprintf("KV event consolidator: closing with %d RouterEvent(s) not delivered to NATS", n))
	}
	o.nc.Close()
}
