package zmqguard

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync/atomic"
)

// Gate holds every connection a listening socket accepts to a small byte
// budget until the peer authenticates: zmq4 buffers each multipart message
// whole (up to Limits.MaxMessageSize) before the application can check it,
// so without a gate a peer that does not know an application-level secret
// still makes the process buffer that much per message. The guard follows
// the peer's frames, hands each complete message of a peer not yet
// authenticated to Verify as well as to zmq4, and disconnects the peer
// before zmq4 reads the header of a frame that would take the bytes it sent
// past Limit. Once a message verifies, the connection is the guard's plain
// Conn again.
//
// A gate applies to the sockets created with a context from WithGate, on
// the connections they accept (Listen) and dial (Dial).
type Gate struct {
	// Limit is how many bytes a peer may send after its ZMTP greeting (its
	// READY command included) until one of its messages verifies.
	Limit int
	// Verify reports whether a message (its frames, in order) authenticates
	// its sender. It runs on the connection's reader goroutine.
	Verify func(frames [][]byte) bool
	// OnDrop, if set, is called when a peer is disconnected for sending
	// more than Limit bytes unauthenticated (from the reader goroutine).
	OnDrop func(remote string, sent uint64)

	authenticated atomic.Uint64
	dropped       atomic.Uint64
	maxSent       atomic.Uint64
}

// GateStats are a Gate's counters.
type GateStats struct {
	Authenticated uint64 // connections whose peer sent a message that verified
	Dropped       uint64 // connections closed for going over Limit unauthenticated
	// MaxUnauthenticatedBytes is the most bytes one peer sent before it
	// authenticated or was dropped (counting from the end of its greeting;
	// never more than Limit): what the process buffered for it.
	MaxUnauthenticatedBytes uint64
}

// Stats returns the gate's counters.
func (g *Gate) Stats() GateStats {
	return GateStats{Authenticated: g.authenticated.Load(), Dropped: g.dropped.Load(),
		MaxUnauthenticatedBytes: g.maxSent.Load()}
}

func (g *Gate) noteSent(n uint64) {
	for {
		old := g.maxSent.Load()
		if n <= old || g.maxSent.CompareAndSwap(old, n) {
			return
		}
	}
}

type gateKey struct{}

// WithGate returns ctx carrying g: a zmq4 socket created with it (zmq4.NewPull
// and the like) gates the connections it accepts on a guarded endpoint.
func WithGate(ctx context.Context, g *Gate) context.Context {
	return context.WithValue(ctx, gateKey{}, g)
}

func gateFrom(ctx context.Context) *Gate {
	g, _ := ctx.Value(gateKey{}).(*Gate)
	return g
}

// maxCommand bounds the READY command of a peer that connects to a gated
// listener: it counts toward Limit. (A dialed connection reads the peer's
// READY through its gate.)
func (g *Gate) maxCommand() uint64 {
	if g == nil {
		return maxHandshakeCommand
	}
	return min(maxHandshakeCommand, uint64(max(g.Limit-9, 0))) // 9: the longest frame header
}

// connGate follows one connection's incoming frames until it authenticates.
// It sees the stream after the handshake; sent starts at the READY command's
// size.
type connGate struct {
	g      *Gate
	remote string
	sent   uint64 // bytes seen after the greeting
	hdr    [9]byte
	hdrGot int
	inBody bool
	left   uint64 // body bytes of the current frame still to come
	cmd    bool   // the current frame is a command (not part of a message)
	more   bool
	body   []byte   // the current data frame's body
	frames [][]byte // the current message's complete frames
}

func newConnGate(g *Gate, remote string, sent uint64) *connGate {
	g.noteSent(sent)
	return &connGate{g: g, remote: remote, sent: sent}
}

// scan advances over p. It reports whether the peer authenticated within p
// (the rest of p then needs no checking), or an error when p takes the peer
// over Limit.
func (s *connGate) scan(p []byte) (bool, error) {
	limit := uint64(max(s.g.Limit, 0))
	for len(p) > 0 {
		if s.inBody {
			k := min(uint64(len(p)), s.left)
			if !s.cmd {
				s.body = append(s.body, p[:k]...)
			}
			s.sent += k
			s.left -= k
			p = p[k:]
			if s.left == 0 && s.endFrame() {
				return true, nil
			}
			continue
		}
		s.hdr[s.hdrGot] = p[0]
		s.hdrGot++
		s.sent++
		p = p[1:]
		if s.sent > limit {
			return false, s.over(0)
		}
		want := 2
		if s.hdr[0]&flagLong != 0 {
			want = 9
		}
		if s.hdrGot < want {
			continue
		}
		size := uint64(s.hdr[1])
		if want == 9 {
			size = binary.BigEndian.Uint64(s.hdr[1:9])
		}
		s.hdrGot = 0
		if size > limit-s.sent {
			return false, s.over(size)
		}
		s.g.noteSent(s.sent + size)
		s.cmd, s.more = s.hdr[0]&flagCommand != 0, s.hdr[0]&flagMore != 0
		s.left, s.inBody = size, size > 0
		if !s.cmd {
			s.body = make([]byte, 0, size)
		}
		if size == 0 && s.endFrame() {
			return true, nil
		}
	}
	s.g.noteSent(s.sent)
	return false, nil
}

// endFrame closes the current frame; true when it completed a message that
// verified.
func (s *connGate) endFrame() bool {
	s.inBody = false
	if s.cmd {
		return false // commands are not part of messages
	}
	s.frames = append(s.frames, s.body)
	s.body = nil
	if s.more {
		return false
	}
	frames := s.frames
	s.frames = nil
	if s.g.Verify == nil || !s.g.Verify(frames) {
		return false
	}
	s.g.authenticated.Add(1)
	return true
}

// over is the error for a peer going past Limit; declared: the frame size
// that would have (0 for a header byte).
func (s *connGate) over(declared uint64) error {
	s.g.dropped.Add(1)
	s.g.noteSent(min(s.sent, uint64(max(s.g.Limit, 0))))
	if s.g.OnDrop != nil {
		s.g.OnDrop(s.remote, s.sent+declared)
	}
	return &scanError{msg: fmt.Sprintf("peer sent %d bytes (next frame %d) without authenticating, over the limit of %d",
		s.sent, declared, s.g.Limit)}
}
