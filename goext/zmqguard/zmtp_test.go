package zmqguard

import (
	"bytes"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func header(flags byte, size uint64) []byte {
	if size > 255 {
		h := []byte{flags | flagLong, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], size)
		return h
	}
	return []byte{flags, byte(size)}
}

// The size check must hold however the stream is cut into reads, including
// inside the 8 size bytes of a long header.
func TestScannerChecksSizeAcrossChunks(t *testing.T) {
	stream := append(header(flagMore, 3), "abc"...)
	stream = append(stream, header(0, 100)...)
	stream = append(stream, make([]byte, 100)...)
	stream = append(stream, header(0, 1<<40)...)
	for cut := 1; cut <= len(stream); cut++ {
		s := frameScanner{max: 1 << 20}
		var err error
		for p := stream; len(p) > 0 && err == nil; {
			n := min(cut, len(p))
			err = s.scan(p[:n])
			p = p[n:]
		}
		var se *scanError
		require.ErrorAs(t, err, &se, "cut %d", cut)
		require.True(t, se.oversized)
	}
}

func TestScannerRules(t *testing.T) {
	for name, tc := range map[string]struct {
		stream []byte
		ok     bool
	}{
		"multipart within the limit": {append(append(header(flagMore, 10), make([]byte, 10)...), header(0, 90)...), true},
		"multipart over the limit":   {append(append(header(flagMore, 60), make([]byte, 60)...), header(0, 60)...), false},
		"limits reset per message":   {append(append(header(0, 60), make([]byte, 60)...), header(0, 60)...), true},
		"reserved flag bit":          {[]byte{0x08, 0}, false},
		"command with MORE":          {[]byte{flagCommand | flagMore, 0}, false},
	} {
		s := frameScanner{max: 100}
		err := s.scan(tc.stream)
		require.Equal(t, tc.ok, err == nil, "%s: %v", name, err)
	}
}

// writeRecorder is a net.Conn that records each write.
type writeRecorder struct {
	net.Conn
	writes [][]byte
}

func (w *writeRecorder) Write(p []byte) (int, error) {
	w.writes = append(w.writes, bytes.Clone(p))
	return len(p), nil
}

func (w *writeRecorder) SetWriteDeadline(time.Time) error { return nil }

// zmq4 writes a message header by header and frame by frame; the peer must
// get it in one system call, as zmq4's writev on a *net.TCPConn does.
func TestWritesGatheredPerMessage(t *testing.T) {
	rec := &writeRecorder{}
	c := newConn(New(Limits{}), rec, nil, false)
	_, err := c.Write(greeting[:])
	require.NoError(t, err)
	require.Empty(t, rec.writes, "zmq4's greeting is dropped")

	var msg []byte
	for _, part := range [][]byte{header(flagMore, 3), []byte("abc"), header(0, 300), bytes.Repeat([]byte{1}, 300)} {
		_, err := c.Write(part)
		require.NoError(t, err)
		msg = append(msg, part...)
	}
	require.Equal(t, [][]byte{msg}, rec.writes)

	// A frame over maxPending goes out on its own, after its header.
	rec.writes = nil
	big := make([]byte, maxPending+1)
	for _, part := range [][]byte{header(0, uint64(len(big))), big} {
		_, err := c.Write(part)
		require.NoError(t, err)
	}
	require.Equal(t, [][]byte{header(0, uint64(len(big))), big}, rec.writes)
}

// However a stream is cut into reads, the scanner reaches the same verdict
// (and never panics).
func FuzzScanner(f *testing.F) {
	f.Add(append(header(flagMore, 3), "abc"...), uint8(1))
	f.Add(header(0, 1<<62), uint8(3))
	f.Add([]byte{flagCommand, 5, 'R', 'E', 'A', 'D', 'Y'}, uint8(2))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		whole := frameScanner{max: 1000}
		errWhole := whole.scan(stream)
		parts := frameScanner{max: 1000}
		step := int(cut%16) + 1
		var errParts error
		for p := stream; len(p) > 0 && errParts == nil; {
			n := min(step, len(p))
			errParts = parts.scan(p[:n])
			p = p[n:]
		}
		require.Equal(t, errWhole == nil, errParts == nil, "cut every %d bytes", step)
		if errWhole == nil {
			require.Equal(t, whole.between, parts.between)
		}
	})
}
