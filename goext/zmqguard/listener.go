package zmqguard

import (
	"errors"
	"net"
	"sync"
	"time"
)

// listener hands zmq4 only connections through their handshake. zmq4's
// accept loop calls Accept and then runs its own handshake, which now reads
// from memory, so no peer can hold that loop.
type listener struct {
	net.Listener
	t     *Transport
	gate  *Gate         // nil: connections are not gated (gate.go)
	ready chan *Conn    // handshakes done, waiting for zmq4's Accept
	done  chan struct{} // closed by Close
	slots chan struct{} // one token per handshake in progress

	// mu's mutex guards its fields.
	mu struct {
		sync.Mutex
		closed  bool
		pending map[net.Conn]struct{} // connections in their handshake
	}
	wg sync.WaitGroup // the accept goroutine and the handshakes
}

func newListener(t *Transport, inner net.Listener, g *Gate) *listener {
	l := &listener{
		Listener: inner,
		t:        t,
		gate:     g,
		ready:    make(chan *Conn),
		done:     make(chan struct{}),
		slots:    make(chan struct{}, t.limits.MaxPendingHandshakes),
	}
	l.mu.pending = make(map[net.Conn]struct{})
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// Accept implements net.Listener.
func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close implements net.Listener: it stops accepting, ends the handshakes in
// progress and waits for their goroutines.
func (l *listener) Close() error {
	l.mu.Lock()
	if l.mu.closed {
		l.mu.Unlock()
		return nil
	}
	l.mu.closed = true
	close(l.done)
	for c := range l.mu.pending {
		_ = c.Close()
	}
	l.mu.Unlock()
	err := l.Listener.Close()
	l.wg.Wait()
	return err
}

func (l *listener) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors and the like: wait rather than spin.
			select {
			case <-l.done:
				return
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		select {
		case l.slots <- struct{}{}:
		default:
			l.t.handshakeFailures.Add(1)
			_ = c.Close()
			continue
		}
		if !l.track(c) {
			<-l.slots
			_ = c.Close()
			return
		}
		l.wg.Add(1)
		go l.handshake(c)
	}
}

// track records c as in its handshake; false once the listener is closed.
func (l *listener) track(c net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.mu.closed {
		return false
	}
	l.mu.pending[c] = struct{}{}
	return true
}

func (l *listener) untrack(c net.Conn) {
	l.mu.Lock()
	delete(l.mu.pending, c)
	l.mu.Unlock()
}

func (l *listener) handshake(c net.Conn) {
	defer l.wg.Done()
	gc, err := l.t.handshake(c, true, l.gate.maxCommand())
	l.untrack(c)
	<-l.slots
	if err != nil {
		l.t.handshakeFailures.Add(1)
		_ = c.Close()
		return
	}
	if l.gate != nil {
		gc.gate = newConnGate(l.gate, c.RemoteAddr().String(), uint64(len(gc.replay)-greetingLen))
	}
	select {
	case l.ready <- gc:
	case <-l.done:
		_ = c.Close()
	}
}
