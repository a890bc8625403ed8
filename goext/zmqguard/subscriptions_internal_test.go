package zmqguard

import (
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

func readyBody(props ...string) []byte {
	b := append([]byte{5}, "READY"...)
	for i := 0; i+1 < len(props); i += 2 {
		b = append(b, byte(len(props[i])))
		b = append(b, props[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(props[i+1])))
		b = append(b, props[i+1]...)
	}
	return b
}

// Every READY that zmq4 reads as a subscriber's is one for the guard (names
// compared without case; any Socket-Type property counts).
func TestPeerIsSubscriber(t *testing.T) {
	for _, tc := range []struct {
		ready []byte
		want  bool
	}{
		{readyBody("Socket-Type", "SUB"), true},
		{readyBody("Identity", "x", "socket-type", "XSUB"), true},
		{readyBody("Socket-Type", "PUSH", "Socket-Type", "SUB"), true},
		{readyBody("Socket-Type", "SUB", "Socket-Type", "PUSH"), true},
		{readyBody("Socket-Type", "PUSH"), false},
		{readyBody("Socket-Type", "sub"), false}, // zmq4 compares the type exactly
		{readyBody("Socket-Type", "SUB")[:12], false},
		{nil, false},
		{[]byte{200}, false},
	} {
		require.Equal(t, tc.want, peerIsSubscriber(tc.ready), "%q", tc.ready)
	}
}

// chunkConn serves a byte stream in chunks of the sizes given.
type chunkConn struct {
	net.Conn
	data   []byte
	chunks []byte
}

func (c *chunkConn) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := len(c.data)
	if len(c.chunks) > 0 {
		n = min(n, int(c.chunks[0])+1)
		c.chunks = c.chunks[1:]
	}
	n = copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

func (c *chunkConn) Close() error         { return nil }
func (c *chunkConn) RemoteAddr() net.Addr { return &net.TCPAddr{} }

// Whatever a subscriber sends, in whatever chunks, the filter hands zmq4
// only ZMTP 3.0 subscription messages, and its topics stay within the caps.
func FuzzSubscriberFilter(f *testing.F) {
	sub := func(b byte, topic string) []byte { return append([]byte{0, byte(1 + len(topic)), b}, topic...) }
	f.Add(sub(1, "a"), []byte{0, 3})
	f.Add(append(sub(1, ""), sub(0, "")...), []byte{})
	f.Add([]byte{0x04, 10, 9, 'S', 'U', 'B', 'S', 'C', 'R', 'I', 'B', 'E'}, []byte{1, 1, 1})
	f.Add([]byte{0x01, 1, 1, 0, 1, 1}, []byte{})
	f.Add([]byte{0x02, 0, 0, 0, 0, 0, 0, 1, 0, 1}, []byte{2})
	f.Fuzz(func(t *testing.T, data, chunks []byte) {
		tr := New(Limits{})
		tr.SetLogger(slog.New(slog.DiscardHandler))
		c := newConn(tr, &chunkConn{data: data, chunks: chunks}, nil, false)
		c.sub = &subscriberFilter{max: uint64(maxSubscriberFrame)}
		out, _ := io.ReadAll(c)
		require.LessOrEqual(t, len(c.sub.topics), MaxSubscriptions)
		require.LessOrEqual(t, c.sub.bytes, MaxSubscriptionBytes)
		for len(out) > 0 {
			require.GreaterOrEqual(t, len(out), 2)
			flags, size, hdr := out[0], uint64(out[1]), 2
			if flags == flagLong {
				require.GreaterOrEqual(t, len(out), 9)
				size, hdr = binary.BigEndian.Uint64(out[1:9]), 9
			} else {
				require.Zero(t, flags)
			}
			require.GreaterOrEqual(t, uint64(len(out)-hdr), size)
			body := out[hdr : hdr+int(size)]
			require.NotEmpty(t, body)
			require.LessOrEqual(t, body[0], byte(1))
			out = out[hdr+int(size):]
		}
	})
}
