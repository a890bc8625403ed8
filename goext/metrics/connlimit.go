package metrics

import (
	"net"
	"sync"
)

// connLimiter is a net.Listener that holds at most max accepted
// connections at once. A connection accepted beyond the limit is closed at
// once rather than left waiting: waiting would keep the kernel's backlog
// full of a flood's connections, queued ahead of an honest scrape, while
// closing costs the descriptor only for an instant.
type connLimiter struct {
	net.Listener
	slots chan struct{} // one token per held connection; capacity max
}

func newConnLimiter(ln net.Listener, max int) *connLimiter {
	return &connLimiter{Listener: ln, slots: make(chan struct{}, max)}
}

// Accept returns the next connection that fits under the limit.
func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		select {
		case l.slots <- struct{}{}:
			return &limitedConn{Conn: c, release: func() { <-l.slots }}, nil
		default:
			_ = c.Close()
		}
	}
}

// limitedConn gives its slot back on its first Close.
type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
