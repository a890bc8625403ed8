package wire

import (
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

// rawPush connects to addr and completes a ZMTP 3.0 NULL handshake by hand
// as a PUSH socket: a local process that knows the protocol, not the secret.
func rawPush(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xFF, 0x7F, 3
	copy(greeting[12:], "NULL")
	_, err = c.Write(greeting)
	require.NoError(t, err)
	_, err = io.ReadFull(c, make([]byte, 64))
	require.NoError(t, err)
	md := append([]byte{11}, "Socket-Type"...)
	md = binary.BigEndian.AppendUint32(md, 4)
	md = append(md, "PUSH"...)
	body := append(append([]byte{5}, "READY"...), md...)
	_, err = c.Write(append([]byte{0x04, byte(len(body))}, body...))
	require.NoError(t, err)
	hdr := make([]byte, 2)
	_, err = io.ReadFull(c, hdr)
	require.NoError(t, err)
	_, err = io.CopyN(io.Discard, c, int64(hdr[1]))
	require.NoError(t, err)
	require.NoError(t, c.SetDeadline(time.Time{}))
	return c
}

// TestUnauthenticatedPeerIsCapped: a process without the secret connects
// to the leader's ack port and sends one 48 MiB frame (under the 64 MiB
// message limit, so only the authentication cap stops it). The leader
// disconnects it before the frame's body, having taken at most
// maxUnauthenticatedBytes from it, and logs and counts the drop; the real
// workers still complete the handshake.
func TestUnauthenticatedPeerIsCapped(t *testing.T) {
	c := newCluster(t, TransportTCP, 2)
	l := c.listen(t, nil)
	peer := rawPush(t, l.Endpoint().AckURL()[len("tcp://"):])
	frame := make([]byte, 9+48<<20)
	frame[0] = 0x02 // a long frame, last of its message
	binary.BigEndian.PutUint64(frame[1:9], 48<<20)
	n, err := peer.Write(frame)
	require.Error(t, err, "the leader must close the connection rather than take the whole frame")
	t.Logf("the peer wrote %d of %d bytes (kernel socket buffers included) before the leader closed it", n, len(frame))
	require.NoError(t, peer.SetReadDeadline(time.Now().Add(10*time.Second)))
	if _, err := io.Copy(io.Discard, peer); err != nil {
		require.ErrorIs(t, err, syscall.ECONNRESET)
	}

	st := l.UnauthenticatedPeers()
	require.Equal(t, uint64(1), st.Dropped)
	require.LessOrEqual(t, st.MaxUnauthenticatedBytes, uint64(maxUnauthenticatedBytes))
	t.Logf("bytes the leader took from the peer before dropping it: %d (cap %d)", st.MaxUnauthenticatedBytes, maxUnauthenticatedBytes)
	require.Contains(t, c.logs.String(), "sent too much before authenticating")

	c.connect(t, 0, nil)
	c.connect(t, 1, nil)
	_, err = l.Handshake(ctxTimeout(t, 20*time.Second))
	require.NoError(t, err)
	require.Equal(t, uint64(2), l.UnauthenticatedPeers().Authenticated, "each worker's first message authenticates it")
	require.Less(t, l.UnauthenticatedPeers().MaxUnauthenticatedBytes, uint64(maxUnauthenticatedBytes),
		"a worker's first message fits under the cap")
}

// TestSquattedLeaderPortIsCapped: a process that took the leader's PUB port
// before it (and does not know the secret) sends a worker's subscription a
// 48 MiB frame. The worker disconnects it having taken at most
// maxUnauthenticatedLeaderBytes, and counts the drop.
func TestSquattedLeaderPortIsCapped(t *testing.T) {
	c := newCluster(t, TransportTCP, 1)
	ln, err := net.Listen("tcp", net.JoinHostPort(c.ep.Host, strconv.Itoa(c.ep.PubPort)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer conn.Close()
		greeting := make([]byte, 64)
		greeting[0], greeting[9], greeting[10] = 0xFF, 0x7F, 3
		copy(greeting[12:], "NULL")
		md := append([]byte{11}, "Socket-Type"...)
		md = binary.BigEndian.AppendUint32(md, 3)
		md = append(md, "PUB"...)
		body := append(append([]byte{5}, "READY"...), md...)
		frame := make([]byte, 9+48<<20)
		frame[0] = 0x02
		binary.BigEndian.PutUint64(frame[1:9], 48<<20)
		_, _ = conn.Write(append(greeting, append([]byte{0x04, byte(len(body))}, body...)...))
		_, _ = io.ReadFull(conn, make([]byte, 64)) // the worker's greeting
		n, err := conn.Write(frame)
		done <- result{n, err}
	}()

	m := c.connect(t, 0, nil)
	r := <-done
	require.Error(t, r.err, "the worker must close the connection rather than take the whole frame")
	checkFor(t, 10*time.Second, func() bool { return m.UnauthenticatedPeers().Dropped >= 1 }, "the worker counts the drop")
	st := m.UnauthenticatedPeers()
	require.LessOrEqual(t, st.MaxUnauthenticatedBytes, uint64(maxUnauthenticatedLeaderBytes))
	t.Logf("the squatter wrote %d of %d bytes (kernel socket buffers included); the worker took %d (cap %d)",
		r.n, 9+48<<20, st.MaxUnauthenticatedBytes, maxUnauthenticatedLeaderBytes)
	require.Contains(t, c.logs.String(), "sent too much before authenticating")
}

// The largest message a leader sends a worker that has not heard it yet, a
// background operation of 256 moves (the leader's default) with their tag
// references, fits under the worker's cap with room to spare.
func TestLargestBackgroundOperationFitsTheWorkersCap(t *testing.T) {
	st := plan.Step{Seq: 1 << 40}
	for i := range 256 {
		st.Moves = append(st.Moves, plan.Copy{Src: plan.G2, SrcBlock: int64(i) << 30, Dst: plan.G3, DstBlock: int64(i) << 30})
		st.TagRefs = append(st.TagRefs, plan.TagRef{Block: int64(i) << 30, ID: 1<<64 - 1})
	}
	b, err := st.Encode()
	require.NoError(t, err)
	frames := newSealer("s", labelToWorkers, labelToLeader).seal(encodeLeader(1<<40, fnStep, b))
	size := 0
	for _, f := range frames {
		size += 9 + len(f) // a long frame header each
	}
	t.Logf("largest background operation: %d bytes on the wire (cap %d)", size, maxUnauthenticatedLeaderBytes)
	require.Less(t, 4*size, maxUnauthenticatedLeaderBytes)
}
