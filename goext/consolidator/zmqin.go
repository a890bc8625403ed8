package consolidator

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// subscribe is the goroutine of one engine endpoint: connect a SUB socket
// (all topics), decode and apply every message, and reconnect with
// exponential backoff when the engine is not there yet or goes away. It
// returns when c.ctx is cancelled (Close), which also unblocks Recv.
//
// The reconnect loop is ours rather than zmq4's WithAutomaticReconnect:
// zmq4 redials inside its connection reaper with a fixed retry count, and
// gives up for good after it; an engine that restarts after minutes must
// still be picked up.
func (c *Consolidator) subscribe(ep string) {
	defer c.subWG.Done()
	dec := events.NewDecoder()
	warn := newWarnLimiter(c.log, "invalid engine input from "+ep)
	defer warn.Flush()
	zlog := slog.NewLogLogger(c.log.Handler(), slog.LevelDebug)
	backoff := c.cfg.ReconnectMin
	warned := false
	c.log.Info("KV event consolidator ZMQ listener connecting to " + ep)
	for c.ctx.Err() == nil {
		// WithDialerMaxRetries(0): one attempt per Dial; the backoff below
		// is the retry policy.
		sub := zmq4.NewSub(c.ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(zlog))
		if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
			_ = sub.Close()
			c.log.Error(fmt.Sprintf("KV event consolidator: subscribe on %s: %v", ep, err))
			return
		}
		if err := sub.Dial(zmqguard.Endpoint(ep)); err != nil {
			_ = sub.Close()
			if !warned {
				c.log.Warn(fmt.Sprintf("KV event consolidator ZMQ listener cannot connect to %s yet (%v); retrying with backoff up to %s",
					ep, err, c.cfg.ReconnectMax))
				warned = true
			}
			if !c.sleep(backoff) {
				return
			}
			backoff = min(2*backoff, c.cfg.ReconnectMax)
			continue
		}
		c.log.Info("KV event consolidator ZMQ listener successfully connected to " + ep)
		backoff, warned = c.cfg.ReconnectMin, false
		for {
			msg, err := sub.Recv()
			if err != nil {
				if c.ctx.Err() == nil {
					c.log.Warn(fmt.Sprintf("KV event consolidator ZMQ listener lost %s (%v); reconnecting", ep, err))
				}
				break
			}
			c.handleMessage(dec, warn, ep, msg.Frames)
		}
		_ = sub.Close()
		if !c.sleep(backoff) {
			return
		}
	}
}

// sleep waits d or until Close; false means stop.
func (c *Consolidator) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.ctx.Done():
		return false
	}
}

// handleMessage decodes one engine message and applies it. Malformed input
// is counted and logged through warn (rate-limited), never fatal.
func (c *Consolidator) handleMessage(dec *events.Decoder, warn *warnLimiter, ep string, frames [][]byte) {
	b, err := dec.DecodeMessage(frames)
	if err != nil {
		warn.Warn(fmt.Sprintf("Failed to deserialize event batch from %s: %v", ep, err))
		c.mu.Lock()
		c.stats.Invalid++
		c.mu.Unlock()
		c.countInvalid(1)
		return
	}
	for _, sk := range b.Skipped {
		warn.Warn(fmt.Sprintf("Skipping engine KV event from %s (batch seq=%d): %v", ep, b.Seq, sk))
	}
	c.applyBatch(&b)
}
