package zmqguard

import (
	"bytes"
	"errors"
	"math"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// peerError is how the guard ends a connection. It is a net.Error that is not
// a timeout, so zmq4 marks the connection closed and removes it from its
// socket (zmq4 retries after a timeout).
type peerError struct{ msg string }

func (e *peerError) Error() string   { return "zmqguard: " + e.msg }
func (e *peerError) Timeout() bool   { return false }
func (e *peerError) Temporary() bool { return false }

var _ net.Error = (*peerError)(nil)

// Conn is a connection past its handshake, as zmq4 sees it.
//
// Reads: first the handshake bytes the guard read (replay), then the stream,
// whose frame headers the scanner checks before zmq4 gets them. zmq4 reads a
// connection from one goroutine at a time (its handshake, then its reader).
//
// Writes: zmq4's greeting is checked against the one the guard sent and
// dropped. Later writes are gathered until a message ends and go out in one
// system call: zmq4 hands a multipart message to net.Buffers, which is one
// writev on a *net.TCPConn but one write per header and per frame on any
// other net.Conn. Every system call gets WriteTimeout. Writes may come from
// several goroutines (a SUB's subscriptions and its socket's writer).
type Conn struct {
	net.Conn
	t *Transport

	replay       []byte // handshake bytes not yet handed to zmq4
	scan         frameScanner
	readDeadline bool // the handshake's read deadline is still set
	// sub filters the stream of a peer that is a subscriber (nil for
	// other peers); it replaces scan once the handshake is replayed.
	sub *subscriberFilter

	dropped atomic.Bool // the guard closed the connection

	gate *connGate // until the peer authenticates (gate.go); nil without a Gate

	// w is the write side; its mutex guards its fields.
	w struct {
		sync.Mutex
		greetGot int          // bytes of zmq4's greeting seen (and dropped)
		out      frameScanner // the outgoing stream, for message ends
		pending  []byte       // start of a message not yet sent
		deadline time.Time    // current write deadline
	}
}

// maxPending bounds the bytes gathered before a message's end; a larger
// frame goes out in a system call of its own.
const maxPending = 64 << 10

// newConn wraps c. inHandshake: the peer's READY command is still to come,
// under c's read deadline, which Read clears once the command is through.
func newConn(t *Transport, c net.Conn, replay []byte, inHandshake bool) *Conn {
	gc := &Conn{Conn: c, t: t, replay: replay, readDeadline: inHandshake,
		scan: frameScanner{max: t.maxMessage.Load(), handshake: inHandshake}}
	gc.w.out = frameScanner{max: math.MaxUint64, between: true}
	return gc
}

// Read implements net.Conn.
func (c *Conn) Read(p []byte) (int, error) {
	if len(c.replay) > 0 {
		n := copy(p, c.replay)
		c.replay = c.replay[n:]
		return n, nil
	}
	if c.sub != nil {
		return c.sub.read(c, p)
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		if serr := c.scan.scan(p[:n]); serr != nil {
			var se *scanError
			if errors.As(serr, &se) && se.oversized {
				c.t.oversized.Add(1)
			}
			return 0, c.drop(serr.Error())
		}
		if c.gate != nil {
			authenticated, gerr := c.gate.scan(p[:n])
			if gerr != nil {
				return 0, c.drop(gerr.Error())
			}
			if authenticated {
				c.gate = nil
			}
		}
		if c.readDeadline && !c.scan.handshake {
			c.readDeadline = false
			if derr := c.Conn.SetReadDeadline(time.Time{}); derr != nil && err == nil {
				err = derr
			}
		}
	}
	return n, err
}

// Write implements net.Conn.
func (c *Conn) Write(p []byte) (int, error) {
	c.w.Lock()
	defer c.w.Unlock()
	greet := 0
	if c.w.greetGot < greetingLen {
		greet = min(len(p), greetingLen-c.w.greetGot)
		if !bytes.Equal(p[:greet], greeting[c.w.greetGot:c.w.greetGot+greet]) {
			// Another mechanism than NULL: the peer already has the
			// guard's greeting, so the handshake cannot go on.
			return 0, c.drop("zmq4 greeting differs from the guard's (only NULL security is supported)")
		}
		c.w.greetGot += greet
	}
	n, err := c.write(p[greet:])
	return greet + n, err
}

// write gathers p, with w held.
func (c *Conn) write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if err := c.w.out.scan(p); err != nil {
		// zmq4 wrote something that is not ZMTP framing: nothing sane
		// can follow on this connection.
		return 0, c.drop("outgoing " + err.Error())
	}
	if len(c.w.pending)+len(p) > maxPending {
		if err := c.send(c.w.pending); err != nil {
			return 0, err
		}
		c.w.pending = c.w.pending[:0]
		if len(p) > maxPending {
			if err := c.send(p); err != nil {
				return 0, err
			}
			return len(p), nil
		}
	}
	c.w.pending = append(c.w.pending, p...)
	if c.w.out.between {
		err := c.send(c.w.pending)
		c.w.pending = c.w.pending[:0]
		if err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// send writes b to the peer, with w held.
func (c *Conn) send(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	wt := c.t.limits.WriteTimeout
	// Moving the deadline costs a timer update; do it only when less than
	// half the timeout is left, so every write still gets at least wt/2.
	if now := time.Now(); c.w.deadline.Sub(now) < wt/2 {
		c.w.deadline = now.Add(wt)
		if err := c.Conn.SetWriteDeadline(c.w.deadline); err != nil {
			return err
		}
	}
	if _, err := c.Conn.Write(b); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.t.slowDropped.Add(1)
			return c.drop("peer did not take a write within " + wt.String())
		}
		return err
	}
	return nil
}

// dropSubscriber drops a subscriber that broke the subscription rules:
// counted, and logged for the first one of the transport.
func (c *Conn) dropSubscriber(reason string) error {
	c.t.subscribersDropped.Add(1)
	err := c.drop(reason)
	if c.t.subscriberLogged.CompareAndSwap(false, true) {
		c.t.logger().Warn("zmqguard: dropped a subscriber; later ones are only counted (kvbm_zmq_subscribers_dropped)",
			"err", err)
	}
	return err
}

// drop closes the connection for a reason the guard found.
func (c *Conn) drop(reason string) error {
	if c.dropped.CompareAndSwap(false, true) {
		_ = c.Conn.Close()
	}
	return &peerError{msg: reason + " (" + c.RemoteAddr().String() + ")"}
}
