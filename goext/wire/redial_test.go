package wire

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// cutProxy forwards TCP connections to a target and can cut every forwarded
// connection at once while still accepting new ones: what a worker sees when
// the leader's PUB drops its subscription (the guard's write timeout after a
// stall) while the leader stays up.
type cutProxy struct {
	l      net.Listener
	target string

	mu       sync.Mutex
	conns    []net.Conn
	accepted int
	frozen   map[net.Conn]bool // client conns whose downstream bytes are dropped
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{l: l, target: target, frozen: map[net.Conn]bool{}}
	go p.serve()
	t.Cleanup(func() {
		_ = l.Close()
		p.cut()
	})
	return p
}

func (p *cutProxy) port() int { return p.l.Addr().(*net.TCPAddr).Port }

func (p *cutProxy) serve() {
	for {
		in, err := p.l.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, in, out)
		p.accepted++
		p.mu.Unlock()
		go func() { _, _ = io.Copy(out, in); _ = out.Close() }()
		go func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := out.Read(buf)
				if n > 0 && !p.isFrozen(in) {
					if _, werr := in.Write(buf[:n]); werr != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			_ = in.Close()
		}()
	}
}

func (p *cutProxy) cut() {
	p.mu.Lock()
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// freeze silently drops what the target sends on the connections open now
// (a half-open connection: the worker hears nothing and sees no error).
func (p *cutProxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := 0; i < len(p.conns); i += 2 {
		p.frozen[p.conns[i]] = true
	}
}

func (p *cutProxy) isFrozen(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.frozen[c]
}

func (p *cutProxy) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// TestWorkerRedialsASubscriptionTheLeaderDropped: the leader's end of a
// worker's SUB connection goes away while both processes live on. zmq4's
// SUB never redials such a connection, so the worker would stop hearing
// pings and operations and stay suspected for good; it notices the
// silence, redials, and operations reach it again.
func TestWorkerRedialsASubscriptionTheLeaderDropped(t *testing.T) {
	for _, tc := range []struct {
		name string
		log  string
		fail func(*cutProxy)
	}{
		// The leader's end closes: the worker reads EOF.
		{"closed", "reconnected its subscription to the leader", (*cutProxy).cut},
		// Nothing arrives and nothing fails: the worker notices the silence.
		{"silent", "no message from the leader's side channel", (*cutProxy).freeze},
	} {
		t.Run(tc.name, func(t *testing.T) { testRedial(t, tc.fail, tc.log) })
	}
}

func testRedial(t *testing.T, fail func(*cutProxy), logLine string) {
	c := newCluster(t, TransportTCP, 1)
	l := c.listen(t, func(o *CoordinatorOptions) {
		o.PingInterval = 50 * time.Millisecond
		o.SuspectAfter = 2 * time.Second
	})
	proxy := newCutProxy(t, net.JoinHostPort("127.0.0.1", strconv.Itoa(l.Endpoint().PubPort)))
	c.ep = Endpoint{Host: "127.0.0.1", PubPort: proxy.port(), AckPort: l.Endpoint().AckPort}
	w := c.connect(t, 0, func(o *MemberOptions) { o.LeaderSilence = 500 * time.Millisecond })
	_, err := l.Handshake(ctxTimeout(t, 10*time.Second))
	require.NoError(t, err)
	require.NoError(t, l.Broadcast(ctxTimeout(t, 5*time.Second), []byte("before")))
	// (A stall of this process longer than LeaderSilence may already have
	// caused a redial: harmless, so not asserted either way.)
	before := proxy.count()

	fail(proxy)

	checkFor(t, 20*time.Second, func() bool { return proxy.count() > before }, "the worker redialed the leader's PUB")
	// Operations reach the rank again (the leader may have suspected it in
	// between; its next answer re-admits it).
	checkFor(t, 20*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return l.Broadcast(ctx, []byte("after")) == nil
	}, "an operation reached the worker after its subscription was cut")
	require.Equal(t, []byte("after"), c.ranks[0].steps()[len(c.ranks[0].steps())-1])
	require.GreaterOrEqual(t, w.Reconnects(), uint64(1))
	require.Contains(t, c.logs.String(), logLine)
	require.Empty(t, l.DeadRanks())
}
