package wire

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// Transport selects how leader and workers talk.
type Transport uint8

const (
	// TransportAuto is TransportInProc when there is exactly one worker
	// (NumWorkers / WorldSize 1: vLLM and TensorRT-LLM run the scheduler and
	// their only worker in one process), else TransportTCP. Set TCP
	// explicitly for a single worker in another process.
	TransportAuto Transport = iota
	// TransportTCP is ZeroMQ PUB/SUB + PUSH/PULL over TCP.
	TransportTCP
	// TransportInProc is the same protocol over Go channels, for a leader
	// and workers in one process. Nothing is bound.
	TransportInProc
)

func (t Transport) String() string {
	switch t {
	case TransportAuto:
		return "auto"
	case TransportTCP:
		return "tcp"
	case TransportInProc:
		return "inproc"
	}
	return fmt.Sprintf("Transport(%d)", uint8(t))
}

// ParseTransport maps "", "auto", "tcp", "inproc" to a Transport.
func ParseTransport(s string) (Transport, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return TransportAuto, nil
	case "tcp", "zmq":
		return TransportTCP, nil
	case "inproc", "in-process", "local":
		return TransportInProc, nil
	}
	return 0, fmt.Errorf("wire: side-channel transport %q: want auto, tcp or inproc", s)
}

func (t Transport) resolve(workers int) Transport {
	if t != TransportAuto {
		return t
	}
	if workers == 1 {
		return TransportInProc
	}
	return TransportTCP
}

// Endpoint is where the leader binds (DYN_KVBM_LEADER_ZMQ_HOST, _PUB_PORT,
// _ACK_PORT). Port 0 binds an ephemeral port (tests); Coordinator.Endpoint reports
// the ports actually bound.
type Endpoint struct {
	Host    string
	PubPort int
	AckPort int
}

// EndpointFrom takes the endpoint from kvbm's configuration.
func EndpointFrom(c *config.Config) Endpoint {
	return Endpoint{Host: c.LeaderZMQHost, PubPort: c.LeaderZMQPubPort, AckPort: c.LeaderZMQAckPort}
}

func (e Endpoint) host() string {
	if e.Host == "" {
		return config.DefaultLeaderZMQHost
	}
	return e.Host
}

// PubURL and AckURL are the ZeroMQ addresses.
func (e Endpoint) PubURL() string {
	return "tcp://" + net.JoinHostPort(e.host(), strconv.Itoa(e.PubPort))
}
func (e Endpoint) AckURL() string {
	return "tcp://" + net.JoinHostPort(e.host(), strconv.Itoa(e.AckPort))
}

// inprocKey names the in-process channel of an endpoint.
func (e Endpoint) inprocKey() string {
	return fmt.Sprintf("%s|%d|%d", e.host(), e.PubPort, e.AckPort)
}

// ErrPortInUse is wrapped by Listen when a port is taken (another engine on
// this host, or a leftover process).
var ErrPortInUse = errors.New("side-channel port already in use") // errprefix: only wrapped, by the bind errors

// errTransportClosed is returned by recv after close.
var errTransportClosed = errors.New("wire: side channel closed")

// leaderTransport is the leader's end: broadcast to every worker, receive
// from any.
type leaderTransport interface {
	broadcast(frames [][]byte) error
	// recv blocks for the next worker message. errTransportClosed after
	// close; any other error is about one peer (a dropped connection) and
	// the channel stays usable.
	recv() ([][]byte, error)
	close() error
}

// workerTransport is a worker's end.
type workerTransport interface {
	send(frames [][]byte) error
	// recv: errTransportClosed after close; any other error means the
	// leader went away.
	recv() ([][]byte, error)
	close() error
}

// zmqLogger routes zmq4's internal complaints (failed ZMTP greetings from
// port scanners, dropped peers) to debug level: the protocol reports what
// matters itself.
func zmqLogger(log *slog.Logger) zmq4.Option {
	return zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelDebug))
}

type tcpLeader struct {
	ctx    context.Context
	cancel context.CancelFunc
	pub    zmq4.Socket
	pull   zmq4.Socket
	mu     sync.Mutex // serialises broadcasts (one multipart message at a time)
	closed atomic.Bool
	pubP   int
	ackP   int
}

// bindError explains a failed bind in terms of the variable to change.
func bindError(sock, envVar string, ep Endpoint, url string, port int, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("wire: cannot bind the side-channel %s socket on %s: %w: %w (%s=%d). "+
			"Another process holds it, typically a second engine on this host using the default ports: "+
			"give each engine its own %s and %s",
			sock, url, ErrPortInUse, syscall.EADDRINUSE, envVar, port, config.EnvLeaderZMQPubPort, config.EnvLeaderZMQAckPort)
	}
	return fmt.Errorf("wire: cannot bind the side-channel %s socket on %s (%s=%q, %s=%d): %w",
		sock, url, config.EnvLeaderZMQHost, ep.host(), envVar, port, err)
}

// listenTCP binds the leader's sockets; gate (may be nil) holds the ack
// socket's peers to a byte budget until they authenticate.
func listenTCP(ep Endpoint, log *slog.Logger, gate *zmqguard.Gate) (*tcpLeader, error) {
	if ep.PubPort != 0 && ep.PubPort == ep.AckPort {
		return nil, fmt.Errorf("wire: %s and %s are both %d; they must differ (both sockets bind on the leader)",
			config.EnvLeaderZMQPubPort, config.EnvLeaderZMQAckPort, ep.PubPort)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t := &tcpLeader{ctx: ctx, cancel: cancel}
	t.pub = zmqguard.NewPub()
	if err := t.pub.Listen(zmqguard.Endpoint(ep.PubURL())); err != nil {
		_ = t.pub.Close()
		cancel()
		return nil, bindError("PUB", config.EnvLeaderZMQPubPort, ep, ep.PubURL(), ep.PubPort, err)
	}
	pullCtx := ctx
	if gate != nil {
		pullCtx = zmqguard.WithGate(ctx, gate)
	}
	t.pull = zmq4.NewPull(pullCtx, zmqLogger(log))
	if err := t.pull.Listen(zmqguard.Endpoint(ep.AckURL())); err != nil {
		_ = t.pull.Close()
		_ = t.pub.Close()
		cancel()
		return nil, bindError("PULL (ack)", config.EnvLeaderZMQAckPort, ep, ep.AckURL(), ep.AckPort, err)
	}
	t.pubP = t.pub.Addr().(*net.TCPAddr).Port
	t.ackP = t.pull.Addr().(*net.TCPAddr).Port
	return t, nil
}

func (t *tcpLeader) broadcast(frames [][]byte) error {
	if t.closed.Load() {
		return errTransportClosed
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.pub.SendMulti(zmq4.NewMsgFrom(frames...))
}

func (t *tcpLeader) recv() ([][]byte, error) {
	msg, err := t.pull.Recv()
	// zmq4 returns an empty message and no error once the socket is closed.
	if t.closed.Load() || t.ctx.Err() != nil {
		return nil, errTransportClosed
	}
	if err != nil {
		return nil, err
	}
	return msg.Frames, nil
}

func (t *tcpLeader) close() error {
	if !t.closed.CompareAndSwap(false, true) {
		return nil
	}
	t.cancel()
	return errors.Join(quietClose(t.pub), quietClose(t.pull))
}

// quietClose closes a socket, ignoring connections that were already gone
// (zmq4 reports every peer that hung up first).
func quietClose(s zmq4.Socket) error {
	if err := s.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		return err
	}
	return nil
}

type tcpWorker struct {
	ctx    context.Context
	subCtx context.Context // ctx, with the gate of the SUB's connections
	cancel context.CancelFunc
	push   zmq4.Socket
	mu     sync.Mutex // serialises sends
	closed atomic.Bool
	pubURL string
	log    *slog.Logger

	subMu sync.Mutex  // guards sub, which redialSub replaces
	sub   zmq4.Socket // nil after close
}

func newSub(ctx context.Context, log *slog.Logger) (zmq4.Socket, error) {
	// WithDialerMaxRetries(0): one attempt per Dial; callers own the retry policy.
	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0), zmqLogger(log))
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("wire: subscribe: %w", err)
	}
	return sub, nil
}

// dialTCP connects SUB and PUSH, retrying every retry until it succeeds or
// stop is closed (the leader may start after its workers). gate (may be nil)
// holds each SUB connection to a byte budget until the leader authenticates.
func dialTCP(ep Endpoint, retry time.Duration, stop <-chan struct{}, log *slog.Logger, gate *zmqguard.Gate) (*tcpWorker, error) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	t := &tcpWorker{ctx: ctx, subCtx: ctx, cancel: cancel, pubURL: ep.PubURL(), log: log}
	if gate != nil {
		t.subCtx = zmqguard.WithGate(ctx, gate)
	}
	// WithDialerMaxRetries(0): one attempt per Dial; the loop below is the
	// retry policy and stops on Close.
	t.push = zmq4.NewPush(ctx, zmq4.WithDialerMaxRetries(0), zmqLogger(log))
	sub, err := newSub(t.subCtx, log)
	if err != nil {
		_ = t.close()
		return nil, err
	}
	t.sub = sub
	warned := false
	for _, s := range []struct {
		sock zmq4.Socket
		url  string
	}{{t.sub, ep.PubURL()}, {t.push, ep.AckURL()}} {
		for {
			err := s.sock.Dial(zmqguard.Endpoint(s.url))
			if err == nil {
				break
			}
			if !warned {
				log.Info("kvbm worker: leader side channel not reachable yet; retrying", "url", s.url, "err", err)
				warned = true
			}
			select {
			case <-stop:
				_ = t.close()
				return nil, errTransportClosed
			case <-time.After(retry):
			}
		}
	}
	return t, nil
}

func (t *tcpWorker) send(frames [][]byte) error {
	if t.closed.Load() {
		return errTransportClosed
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.push.SendMulti(zmq4.NewMsgFrom(frames...))
}

func (t *tcpWorker) recv() ([][]byte, error) {
	for {
		t.subMu.Lock()
		sub := t.sub
		t.subMu.Unlock()
		if sub == nil {
			return nil, errTransportClosed
		}
		msg, err := sub.Recv()
		if t.closed.Load() || t.ctx.Err() != nil {
			return nil, errTransportClosed
		}
		t.subMu.Lock()
		replaced := t.sub != sub
		t.subMu.Unlock()
		if replaced {
			// redialSub closed this socket under the receive: read the new one.
			if err == nil && len(msg.Frames) > 0 {
				return msg.Frames, nil
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		return msg.Frames, nil
	}
}

// redialSub replaces the SUB socket with a newly dialed one. zmq4's SUB does
// not redial a connection the publisher dropped (the leader's guard drops a
// subscriber that took no data for its write timeout, e.g. a worker process
// stalled for a few seconds): without a redial the worker would never hear
// the leader again and stay suspected for good.
func (t *tcpWorker) redialSub(installed func()) error {
	if t.closed.Load() {
		return errTransportClosed
	}
	sub, err := newSub(t.subCtx, t.log)
	if err != nil {
		return err
	}
	if err := sub.Dial(zmqguard.Endpoint(t.pubURL)); err != nil {
		_ = quietClose(sub)
		return err
	}
	t.subMu.Lock()
	old := t.sub
	if old == nil || t.closed.Load() {
		t.subMu.Unlock()
		_ = quietClose(sub)
		return errTransportClosed
	}
	if installed != nil {
		installed() // under subMu: the receive loop cannot use sub yet
	}
	t.sub = sub
	t.subMu.Unlock()
	return quietClose(old)
}

func (t *tcpWorker) close() error {
	if !t.closed.CompareAndSwap(false, true) {
		return nil
	}
	t.cancel()
	t.subMu.Lock()
	sub := t.sub
	t.sub = nil
	t.subMu.Unlock()
	var errSub error
	if sub != nil {
		errSub = quietClose(sub)
	}
	return errors.Join(errSub, quietClose(t.push))
}
