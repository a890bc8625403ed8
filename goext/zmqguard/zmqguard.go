// Package zmqguard puts a guard between the network and go-zeromq/zmq4 for
// every TCP endpoint kvbm binds or dials. It is a zmq4 transport (registered
// under Network through zmq4.RegisterTransport), so zmq4 stays an unmodified
// dependency and kvbm's endpoint strings stay tcp://… for users: Endpoint
// rewrites them where kvbm creates its sockets.
//
// zmq4 v0.17 trusts its peers in four ways that a hostile or broken peer
// turns into an outage:
//
//   - It allocates the size a frame header declares before reading the body,
//     so 73 bytes declaring 2^62 bytes abort the process (the panic is in a
//     zmq4 goroutine, out of reach of any recover in kvbm). The guard's Conn
//     follows the frame headers of the incoming stream and closes the
//     connection when a frame or a multipart message declares more than
//     Limits.MaxMessageSize, before zmq4 sees the header (like libzmq's
//     ZMQ_MAXMSGSIZE).
//   - It runs the ZMTP handshake inside its accept loop without a deadline,
//     so one idle TCP connection blocks every later peer. The guard's listener
//     runs each peer's handshake (greeting and READY command) in a goroutine
//     of its own, bounded by Limits.HandshakeTimeout, and hands zmq4 only
//     connections whose handshake bytes have all arrived; zmq4 then replays
//     them from memory.
//   - A PUB socket writes to each subscriber in turn with blocking writes, so
//     one subscriber that stops reading stops delivery to all. The guard's
//     Conn gives every write Limits.WriteTimeout and drops the peer when it
//     expires.
//   - A PUB keeps every distinct topic a subscriber sends for as long as the
//     connection lives and checks each message against all of them, and it
//     queues any other message a peer sends where nothing reads it. The
//     guard's Conn filters what a subscriber sends on a connection the
//     listener accepted (kvbm's publishers bind) through subscriberFilter: it
//     drops a peer over MaxSubscriptions or MaxSubscriptionBytes and hands
//     zmq4 only subscriptions.
//
// Only the NULL security mechanism is supported: it is the one kvbm and the
// engines it talks to use.
//
// Goroutines: a listener owns one accept goroutine (stops when the listener is
// closed) and one goroutine per handshake in progress (at most
// Limits.MaxPendingHandshakes, each bounded by HandshakeTimeout and ended
// early by closing the listener).
package zmqguard

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// Network is the zmq4 transport name of the guarded TCP transport with
// DefaultLimits.
const Network = "kvbm+tcp"

// Limits bound what one peer can make kvbm spend.
type Limits struct {
	// MaxMessageSize caps a frame, a command, and the sum of the frames of
	// one multipart message, in bytes. A peer that declares more is
	// disconnected before anything is allocated.
	MaxMessageSize uint64
	// HandshakeTimeout bounds a peer's ZMTP greeting and READY command.
	HandshakeTimeout time.Duration
	// WriteTimeout bounds every write to a peer; a peer that does not take
	// the bytes in time (a subscriber that stopped reading) is dropped.
	WriteTimeout time.Duration
	// MaxPendingHandshakes caps connections accepted but not yet through
	// their handshake; further connections are closed at once.
	MaxPendingHandshakes int
}

// DefaultLimits are the limits of the transport registered as Network.
// 64 MiB is well above the largest legitimate message: a plan takes 18 bytes
// per block copy (a million copies is 18 MiB) and an engine's event batch
// holds one step's blocks.
var DefaultLimits = Limits{
	MaxMessageSize:       64 << 20,
	HandshakeTimeout:     5 * time.Second,
	WriteTimeout:         5 * time.Second,
	MaxPendingHandshakes: 256,
}

// Stats counts the peers a Transport turned away.
type Stats struct {
	// HandshakeFailures: peers whose greeting or READY command was invalid,
	// did not arrive within HandshakeTimeout, or found MaxPendingHandshakes
	// reached.
	HandshakeFailures uint64
	// OversizedMessages: peers that declared a frame or message over
	// MaxMessageSize, or, from a subscriber, a frame longer than any
	// subscription within MaxSubscriptionBytes.
	OversizedMessages uint64
	// SlowPeersDropped: peers that did not take a write within WriteTimeout.
	SlowPeersDropped uint64
	// SubscribersDropped: subscribers of a publisher that went over
	// MaxSubscriptions or MaxSubscriptionBytes, or sent invalid frame
	// flags.
	SubscribersDropped uint64
}

// Transport is a zmq4 transport over TCP that enforces Limits on every
// connection it listens for or dials.
type Transport struct {
	limits     Limits
	maxMessage atomic.Uint64 // Limits.MaxMessageSize, as SetMaxMessageSize left it
	tcp        transport.Transport

	handshakeFailures atomic.Uint64
	oversized         atomic.Uint64
	slowDropped       atomic.Uint64

	subscribersDropped atomic.Uint64
	subscriberLogged   atomic.Bool // the first dropped subscriber was logged
	log                atomic.Pointer[slog.Logger]
}

var _ transport.Transport = (*Transport)(nil)

// New returns a guarded TCP transport; zero fields of l take DefaultLimits.
func New(l Limits) *Transport {
	if l.MaxMessageSize == 0 {
		l.MaxMessageSize = DefaultLimits.MaxMessageSize
	}
	if l.HandshakeTimeout <= 0 {
		l.HandshakeTimeout = DefaultLimits.HandshakeTimeout
	}
	if l.WriteTimeout <= 0 {
		l.WriteTimeout = DefaultLimits.WriteTimeout
	}
	if l.MaxPendingHandshakes <= 0 {
		l.MaxPendingHandshakes = DefaultLimits.MaxPendingHandshakes
	}
	t := &Transport{limits: l, tcp: transport.New("tcp")}
	t.maxMessage.Store(l.MaxMessageSize)
	return t
}

// Register registers a guarded TCP transport with zmq4 under name (endpoints
// name://host:port) and returns it, for its Stats.
func Register(name string, l Limits) (*Transport, error) {
	t := New(l)
	if err := zmq4.RegisterTransport(name, t); err != nil {
		return nil, fmt.Errorf("zmqguard: register transport %q: %w", name, err)
	}
	return t, nil
}

var defaultTransport *Transport

func init() {
	t, err := Register(Network, DefaultLimits)
	if err != nil {
		panic(err)
	}
	defaultTransport = t
}

// Default returns the transport registered as Network.
func Default() *Transport { return defaultTransport }

// Endpoint maps a tcp:// endpoint to the guarded transport; other endpoints
// (ipc://, inproc://) are returned unchanged.
func Endpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return Network + "://" + rest
	}
	return ep
}

// Limits returns the transport's limits.
func (t *Transport) Limits() Limits {
	l := t.limits
	l.MaxMessageSize = t.maxMessage.Load()
	return l
}

// SetMaxMessageSize changes Limits.MaxMessageSize for connections made from
// now on (n = 0: DefaultLimits'). kvbm applies DYN_KVBM_ZMQ_MAX_MESSAGE_MB
// to the Default transport this way.
func (t *Transport) SetMaxMessageSize(n uint64) {
	if n == 0 {
		n = DefaultLimits.MaxMessageSize
	}
	t.maxMessage.Store(n)
}

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	return Stats{
		HandshakeFailures: t.handshakeFailures.Load(),
		OversizedMessages: t.oversized.Load(),
		SlowPeersDropped:  t.slowDropped.Load(),

		SubscribersDropped: t.subscribersDropped.Load(),
	}
}

// SetLogger sets where the transport logs (nil: slog.Default()).
func (t *Transport) SetLogger(l *slog.Logger) { t.log.Store(l) }

func (t *Transport) logger() *slog.Logger {
	if l := t.log.Load(); l != nil {
		return l
	}
	return slog.Default()
}

// Addr implements transport.Transport: host:port as for tcp://.
func (t *Transport) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

// Listen implements transport.Transport.
func (t *Transport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	inner, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return newListener(t, inner, gateFrom(ctx)), nil
}

// Dial implements transport.Transport. The handshake runs here, bounded by
// HandshakeTimeout and ctx, so a server that accepts and then stays silent
// cannot hold the dialer.
func (t *Transport) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	c, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	gc, err := t.handshake(c, false, maxHandshakeCommand)
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	if g := gateFrom(ctx); g != nil {
		gc.gate = newConnGate(g, addr, 0) // the peer's READY comes through the gate
	}
	return gc, nil
}
