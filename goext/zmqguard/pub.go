package zmqguard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
)

// Pub is kvbm's PUB socket: zmq4.NewPub's behaviour on the wire (ZMTP 3.0,
// NULL security, prefix-matched topics), listening through a guarded
// Transport only. It exists because every zmq4 PUB leaves its writer
// goroutine and queue behind when closed (zmq4 v0.17's socket Close never
// stops them, and nothing public can), and a Pub's Close ends every
// goroutine it started.
//
// Each subscriber has a queue and a writer goroutine of its own, so a slow
// subscriber delays only itself (and is dropped by the transport's
// WriteTimeout once it stops reading), and a reader goroutine that keeps its
// topics: what the Conn's subscriberFilter lets through, so at most
// MaxSubscriptions topics of MaxSubscriptionBytes in all.
//
// Goroutines: one accept loop while listening, and a reader and a writer
// per subscriber; Close ends them all and waits for them.
type Pub struct {
	t *Transport

	// mu's mutex guards its fields.
	mu struct {
		sync.Mutex
		ln     net.Listener
		hwm    int // messages queued per subscriber; 0: no limit
		peers  map[*pubPeer]struct{}
		closed bool
	}
	wg sync.WaitGroup
}

var (
	_ zmq4.Socket = (*Pub)(nil)
	_ zmq4.Topics = (*Pub)(nil)
)

// NewPub returns an unbound PUB socket that listens through t.
func (t *Transport) NewPub() *Pub {
	p := &Pub{t: t}
	p.mu.peers = make(map[*pubPeer]struct{})
	return p
}

// NewPub returns an unbound PUB socket that listens through Default().
func NewPub() *Pub { return Default().NewPub() }

// errPub prefixes the Pub's errors.
//
// errprefix: the format is appended to "zmqguard: PUB: ".
func errPub(format string, a ...any) error {
	return fmt.Errorf("zmqguard: PUB: "+format, a...)
}

// Listen binds ep: tcp://host:port, or the transport's own scheme (Endpoint's
// rewriting of tcp://). A Pub listens once.
func (p *Pub) Listen(ep string) error {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok || scheme != "tcp" && !strings.HasPrefix(scheme, Network) {
		return errPub("endpoint %q: want tcp://host:port", ep)
	}
	addr, err := p.t.Addr(rest)
	if err != nil {
		return errPub("endpoint %q: %w", ep, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return errPub("listen on %s: socket closed", ep)
	}
	if p.mu.ln != nil {
		return errPub("listen on %s: already listening on %s", ep, p.mu.ln.Addr())
	}
	ln, err := p.t.Listen(context.Background(), addr)
	if err != nil {
		return errPub("listen on %s: %w", ep, err)
	}
	p.mu.ln = ln
	p.wg.Add(1)
	go p.acceptLoop(ln)
	return nil
}

func (p *Pub) acceptLoop(ln net.Listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return // only once the listener is closed
		}
		p.add(c.(*Conn))
	}
}

// add starts serving a connection through its handshake.
func (p *Pub) add(c *Conn) {
	if c.sub == nil {
		// Not a SUB or XSUB: zmq4's PUB refuses it too.
		_ = c.Close()
		return
	}
	// The Conn replays the peer's greeting and READY for zmq4; the guard
	// already checked them, and a Pub has nothing more to learn from them.
	c.replay = nil
	peer := &pubPeer{c: c, wake: make(chan struct{}, 1)}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		_ = c.Close()
		return
	}
	p.mu.peers[peer] = struct{}{}
	p.wg.Add(2)
	go p.read(peer)
	go p.write(peer)
}

// remove forgets a peer and closes its connection (either goroutine, once
// it fails; or Close).
func (p *Pub) remove(peer *pubPeer) {
	p.mu.Lock()
	delete(p.mu.peers, peer)
	p.mu.Unlock()
	peer.close()
}

// readyPub is this side's READY command: greeting, then READY with the
// socket type, as zmq4's PUB sends them.
var readyPub = func() []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(zmq4.Pub)))
	body = append(body, zmq4.Pub...)
	return append(append(greeting[:], flagCommand, byte(len(body))), body...)
}()

// read keeps the peer's topics from its subscriptions until the connection
// ends. The Conn hands over only ZMTP 3.0 subscription messages.
func (p *Pub) read(peer *pubPeer) {
	defer p.wg.Done()
	defer p.remove(peer)
	var hdr [9]byte
	body := make([]byte, 0, 256)
	for {
		if _, err := io.ReadFull(peer.c, hdr[:2]); err != nil {
			return
		}
		size := uint64(hdr[1])
		if hdr[0]&flagLong != 0 {
			if _, err := io.ReadFull(peer.c, hdr[2:9]); err != nil {
				return
			}
			size = binary.BigEndian.Uint64(hdr[1:9])
		}
		// Bounded by the Conn's filter (maxSubscriberFrame).
		body = slices.Grow(body[:0], int(size))[:size]
		if _, err := io.ReadFull(peer.c, body); err != nil {
			return
		}
		if len(body) > 0 {
			peer.subscribe(body[0] == 1, body[1:])
		}
	}
}

// write sends this side's handshake, then the peer's queue, until the
// connection fails or the peer is closed.
func (p *Pub) write(peer *pubPeer) {
	defer p.wg.Done()
	defer p.remove(peer)
	if _, err := peer.c.Write(readyPub); err != nil {
		return
	}
	var batch [][]byte
	for {
		<-peer.wake
		var open bool
		batch, open = peer.take(batch[:0])
		if !open {
			return
		}
		for _, m := range batch {
			if _, err := peer.c.Write(m); err != nil {
				return
			}
		}
		clear(batch)
	}
}

// Send queues msg for every subscriber whose topics match its first frame.
// It does not block: a subscriber's queue over the high-water mark
// (zmq4.OptionHWM; 0, the default, is no limit) drops the message for that
// subscriber.
func (p *Pub) Send(msg zmq4.Msg) error {
	if len(msg.Frames) == 0 {
		return errPub("send: a message needs at least one frame")
	}
	wire := encodeMessage(msg.Frames)
	topic := string(msg.Frames[0])
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return errPub("send: socket closed")
	}
	for peer := range p.mu.peers {
		peer.enqueue(topic, wire, p.mu.hwm)
	}
	return nil
}

// SendMulti is Send: every message goes out as one multipart message.
func (p *Pub) SendMulti(msg zmq4.Msg) error { return p.Send(msg) }

// encodeMessage is frames on the wire: ZMTP 3.0 frames, MORE on all but the
// last.
func encodeMessage(frames [][]byte) []byte {
	n := 0
	for _, f := range frames {
		n += 9 + len(f)
	}
	b := make([]byte, 0, n)
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		if len(f) > 255 {
			b = append(b, flags|flagLong)
			b = binary.BigEndian.AppendUint64(b, uint64(len(f)))
		} else {
			b = append(b, flags, byte(len(f)))
		}
		b = append(b, f...)
	}
	return b
}

// Close stops listening, closes every connection and waits for the
// socket's goroutines to end.
func (p *Pub) Close() error {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return nil
	}
	p.mu.closed = true
	ln := p.mu.ln
	peers := make([]*pubPeer, 0, len(p.mu.peers))
	for peer := range p.mu.peers {
		peers = append(peers, peer)
	}
	p.mu.Unlock()
	var err error
	if ln != nil {
		if cerr := ln.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
			err = errPub("close: %w", cerr)
		}
	}
	for _, peer := range peers {
		peer.close()
	}
	p.wg.Wait()
	return err
}

// Recv is not supported: a PUB only sends.
func (*Pub) Recv() (zmq4.Msg, error) {
	return zmq4.Msg{}, errPub("recv: a PUB socket only sends")
}

// Dial is not supported: kvbm's publishers bind.
func (*Pub) Dial(ep string) error {
	return errPub("dial %s: this PUB socket only listens", ep)
}

// Type implements zmq4.Socket.
func (*Pub) Type() zmq4.SocketType { return zmq4.Pub }

// Addr returns the bound address; nil before Listen.
func (p *Pub) Addr() net.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.ln == nil {
		return nil
	}
	return p.mu.ln.Addr()
}

// GetOption returns zmq4.OptionHWM; other options are not supported.
func (p *Pub) GetOption(name string) (any, error) {
	if name != zmq4.OptionHWM {
		return nil, zmq4.ErrBadProperty
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mu.hwm, nil
}

// SetOption sets zmq4.OptionHWM (an int, messages queued per subscriber;
// 0: no limit); other options are not supported.
func (p *Pub) SetOption(name string, value any) error {
	hwm, ok := value.(int)
	if name != zmq4.OptionHWM || !ok || hwm < 0 {
		return zmq4.ErrBadProperty
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mu.hwm = hwm
	return nil
}

// Topics returns the sorted topics of every subscriber, once each.
func (p *Pub) Topics() []string {
	p.mu.Lock()
	peers := make([]*pubPeer, 0, len(p.mu.peers))
	for peer := range p.mu.peers {
		peers = append(peers, peer)
	}
	p.mu.Unlock()
	set := make(map[string]struct{})
	for _, peer := range peers {
		peer.mu.Lock()
		for tp := range peer.mu.topics {
			set[tp] = struct{}{}
		}
		peer.mu.Unlock()
	}
	out := make([]string, 0, len(set))
	for tp := range set {
		out = append(out, tp)
	}
	slices.Sort(out)
	return out
}

// pubPeer is one subscriber of a Pub.
type pubPeer struct {
	c    *Conn
	wake chan struct{} // capacity 1: the queue has messages, or closed

	// mu's mutex guards its fields.
	mu struct {
		sync.Mutex
		topics map[string]struct{}
		queue  [][]byte // encoded messages
		closed bool
	}
}

func (peer *pubPeer) subscribe(sub bool, topic []byte) {
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if !sub {
		delete(peer.mu.topics, string(topic))
		return
	}
	if peer.mu.topics == nil {
		peer.mu.topics = make(map[string]struct{})
	}
	peer.mu.topics[string(topic)] = struct{}{}
}

func (peer *pubPeer) enqueue(topic string, wire []byte, hwm int) {
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.mu.closed || hwm > 0 && len(peer.mu.queue) >= hwm {
		return
	}
	match := false
	for tp := range peer.mu.topics {
		if strings.HasPrefix(topic, tp) {
			match = true
			break
		}
	}
	if !match {
		return
	}
	peer.mu.queue = append(peer.mu.queue, wire)
	select {
	case peer.wake <- struct{}{}:
	default:
	}
}

// take moves the queue to dst; false once the peer is closed.
func (peer *pubPeer) take(dst [][]byte) ([][]byte, bool) {
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.mu.closed {
		return dst, false
	}
	dst = append(dst, peer.mu.queue...)
	clear(peer.mu.queue)
	peer.mu.queue = peer.mu.queue[:0]
	return dst, true
}

func (peer *pubPeer) close() {
	peer.mu.Lock()
	already := peer.mu.closed
	peer.mu.closed = true
	peer.mu.queue = nil
	peer.mu.Unlock()
	if !already {
		_ = peer.c.Close()
		select {
		case peer.wake <- struct{}{}:
		default:
		}
	}
}
