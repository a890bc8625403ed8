package zmqguard

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// ZMTP 3.x framing (https://rfc.zeromq.org/spec/23/). A connection starts
// with a 64-byte greeting from each side: signature (0xFF, 8 bytes of
// padding, 0x7F), version major and minor, mechanism (20 bytes, NUL padded),
// as-server (1 byte), filler (31 bytes). Frames follow: a flags byte, the
// size in 1 byte (short) or 8 bytes big-endian (long, flag 0x02), then the
// body. The first frame of each side is the mechanism's handshake command;
// for NULL it is READY.
const (
	greetingLen = 64

	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
	flagsKnown  = flagMore | flagLong | flagCommand

	// maxHandshakeCommand bounds the READY command read during the
	// handshake: its metadata is a socket type and an identity of at most
	// 255 bytes, so 64 KiB leaves room for any properties a peer adds while
	// keeping pending handshakes cheap.
	maxHandshakeCommand = 64 << 10
)

// greeting is what the guard sends on zmq4's behalf: byte for byte the
// greeting zmq4 sends with NULL security (version 3.0, as-server 0), so the
// greeting zmq4 writes afterwards can be checked against it and dropped.
var greeting = func() [greetingLen]byte {
	var g [greetingLen]byte
	g[0], g[9] = 0xFF, 0x7F
	g[10], g[11] = 3, 0
	copy(g[12:32], "NULL")
	return g
}()

// checkGreeting validates a peer's greeting: ZMTP 3.x with NULL security.
func checkGreeting(g []byte) error {
	if g[0] != 0xFF || g[9] != 0x7F {
		return fmt.Errorf("zmqguard: not a ZMTP 3 greeting (signature % x)", g[:10])
	}
	if g[10] < 3 {
		return fmt.Errorf("zmqguard: ZMTP version %d.%d; want 3.x", g[10], g[11])
	}
	if mech := g[12:32]; !bytes.Equal(mech, greeting[12:32]) {
		return fmt.Errorf("zmqguard: security mechanism %q; want NULL", bytes.TrimRight(mech, "\x00"))
	}
	return nil
}

// handshake runs the guard's part of the ZMTP handshake within
// HandshakeTimeout: it sends the guard's greeting and reads the peer's. A
// listening guard (accepted) also reads the peer's first command, READY,
// which every ZMTP peer sends without waiting for the other side's: so zmq4's
// handshake on the returned connection reads only from memory. A dialing
// guard cannot wait for it (the peer may be a listening guard, waiting for
// this side's READY): zmq4 reads it, under the scanner's handshake rules and
// the remaining deadline. The returned connection replays what was read and
// drops zmq4's own greeting.
//
// maxCommand bounds the READY command (maxHandshakeCommand, or less under a
// Gate).
func (t *Transport) handshake(c net.Conn, accepted bool, maxCommand uint64) (*Conn, error) {
	deadline := time.Now().Add(t.limits.HandshakeTimeout)
	if err := c.SetDeadline(deadline); err != nil {
		return nil, err
	}
	if _, err := c.Write(greeting[:]); err != nil {
		return nil, fmt.Errorf("zmqguard: send greeting: %w", err)
	}
	// greeting, then the READY command's header (at most 9 bytes) and body.
	buf := make([]byte, greetingLen, greetingLen+9+256)
	if _, err := io.ReadFull(c, buf); err != nil {
		return nil, fmt.Errorf("zmqguard: read greeting: %w", err)
	}
	if err := checkGreeting(buf); err != nil {
		return nil, err
	}
	if !accepted {
		if err := c.SetWriteDeadline(time.Time{}); err != nil {
			return nil, err
		}
		return newConn(t, c, buf, true), nil
	}
	var hdr [9]byte
	if _, err := io.ReadFull(c, hdr[:2]); err != nil {
		return nil, fmt.Errorf("zmqguard: read handshake command: %w", err)
	}
	flags, n := hdr[0], 2
	if flags&^(flagLong|flagCommand) != 0 || flags&flagCommand == 0 {
		return nil, fmt.Errorf("zmqguard: handshake frame flags %#x; want a command", flags)
	}
	size := uint64(hdr[1])
	if flags&flagLong != 0 {
		if _, err := io.ReadFull(c, hdr[2:9]); err != nil {
			return nil, fmt.Errorf("zmqguard: read handshake command: %w", err)
		}
		size, n = binary.BigEndian.Uint64(hdr[1:9]), 9
	}
	if size > maxCommand {
		return nil, fmt.Errorf("zmqguard: handshake command of %d bytes (limit %d)", size, maxCommand)
	}
	buf = append(buf, hdr[:n]...)
	buf = append(buf, make([]byte, size)...)
	if _, err := io.ReadFull(c, buf[len(buf)-int(size):]); err != nil {
		return nil, fmt.Errorf("zmqguard: read handshake command: %w", err)
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	gc := newConn(t, c, buf, false)
	if peerIsSubscriber(buf[len(buf)-int(size):]) {
		gc.sub = &subscriberFilter{max: min(uint64(maxSubscriberFrame), gc.scan.max)}
	}
	return gc, nil
}

// frameScanner follows the ZMTP frame headers of a stream, one chunk at a
// time. On the incoming stream it refuses a frame or message over max before
// the chunk holding the last byte of its size reaches zmq4; on the outgoing
// one it finds where messages end.
type frameScanner struct {
	max uint64
	// handshake: the next frame is the peer's handshake command, of at most
	// maxHandshakeCommand bytes. Cleared once that frame has been read.
	handshake bool

	inBody  bool
	flags   byte
	sizeBuf [8]byte
	sizeGot int    // size bytes seen of the current header
	body    uint64 // body bytes left of the current frame
	msg     uint64 // bytes declared so far by the current multipart message
	more    bool   // the current frame has the MORE flag
	// between: the stream is between two messages (or commands).
	between bool
}

// scanError is a stream the guard refuses.
type scanError struct {
	oversized bool
	msg       string
}

func (e *scanError) Error() string { return e.msg }

// scan advances over p. It returns an error for a frame with reserved flag
// bits set or one whose size would take the message over max.
func (s *frameScanner) scan(p []byte) error {
	for len(p) > 0 {
		if s.inBody {
			k := uint64(len(p))
			if k > s.body {
				k = s.body
			}
			s.body -= k
			p = p[k:]
			if s.body == 0 {
				s.inBody = false
				s.handshake = false
				s.between = !s.more
			}
			continue
		}
		if s.sizeGot == 0 && s.flags == 0 {
			// A flags byte. 0 is a valid one, so the stored flags carry
			// 0x80 (a reserved bit) to mark a header in progress.
			f := p[0]
			p = p[1:]
			if f&^flagsKnown != 0 || f&(flagCommand|flagMore) == flagCommand|flagMore {
				return &scanError{msg: fmt.Sprintf("frame flags %#x", f)}
			}
			if s.handshake && f&flagCommand == 0 {
				return &scanError{msg: fmt.Sprintf("handshake frame flags %#x; want a command", f)}
			}
			s.flags = f | 0x80 // 0x80: header started
			s.between = false
			continue
		}
		want := 1
		if s.flags&flagLong != 0 {
			want = 8
		}
		k := copy(s.sizeBuf[s.sizeGot:want], p)
		s.sizeGot += k
		p = p[k:]
		if s.sizeGot < want {
			continue
		}
		size := uint64(s.sizeBuf[0])
		if want == 8 {
			size = binary.BigEndian.Uint64(s.sizeBuf[:])
		}
		if s.handshake && size > maxHandshakeCommand {
			return &scanError{oversized: true, msg: fmt.Sprintf("handshake command of %d bytes (limit %d)", size, maxHandshakeCommand)}
		}
		if size > s.max || s.msg > s.max-size {
			return &scanError{oversized: true, msg: fmt.Sprintf("frame of %d bytes (message so far %d) over the limit of %d bytes", size, s.msg, s.max)}
		}
		s.msg += size
		s.more = s.flags&flagMore != 0
		if !s.more {
			s.msg = 0
		}
		s.flags, s.sizeGot = 0, 0
		s.body, s.inBody = size, size > 0
		if size == 0 {
			s.handshake = false
			s.between = !s.more
		}
	}
	return nil
}
