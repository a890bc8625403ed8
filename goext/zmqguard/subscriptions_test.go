package zmqguard_test

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// subscribe encodes a ZMTP 3.0 subscription (sub) or cancellation message.
func subscribe(sub bool, topic string) []byte {
	b := []byte{0}
	if sub {
		b[0] = 1
	}
	b = append(b, topic...)
	return append(frameHeader(0, uint64(len(b))), b...)
}

// topicCount is the number of distinct topics zmq4's PUB holds.
func topicCount(pub zmq4.Socket) int { return len(pub.(zmq4.Topics).Topics()) }

// waitTopics waits until pub holds n distinct topics.
func waitTopics(t *testing.T, pub zmq4.Socket, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return topicCount(pub) == n }, 5*time.Second, 5*time.Millisecond,
		"PUB holds %d topics, want %d", topicCount(pub), n)
}

// requireOpen checks that the PUB side has not closed c: a read finds
// nothing to read rather than the end of the stream.
func requireOpen(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	require.ErrorAs(t, err, &ne, "the PUB side closed the connection")
	require.True(t, ne.Timeout(), "the PUB side closed the connection: %v", err)
	require.NoError(t, c.SetReadDeadline(time.Time{}))
}

// zmq4's PUB kept every distinct topic a peer subscribed to. A peer that
// subscribes past MaxSubscriptions topics is dropped, with what it
// subscribed to; honest subscribers keep receiving.
func TestSubscriptionFloodDropsPeer(t *testing.T) {
	before := zmqguard.Default().Stats()
	pub, addr := bindPub(t, zmqguard.Network)
	honest := dialSub(t, zmqguard.Network, addr)
	waitTopics(t, pub, 1) // the honest subscriber's ""

	c := rawPeer(t, addr, "SUB")
	var batch []byte
	for i := range zmqguard.MaxSubscriptions {
		batch = append(batch, subscribe(true, fmt.Sprintf("topic-%04d", i))...)
	}
	_, err := c.Write(batch)
	require.NoError(t, err)
	waitTopics(t, pub, 1+zmqguard.MaxSubscriptions) // up to the cap: kept
	requireOpen(t, c)

	// Far past the cap, as a flood sends: the guard cuts the peer at the
	// first topic over it, whatever follows.
	batch = batch[:0]
	for i := range 5000 {
		batch = append(batch, subscribe(true, fmt.Sprintf("flood-%06d", i))...)
	}
	_, _ = c.Write(batch) // the guard may cut the connection mid-write
	requireClosedByPeer(t, c)
	require.Equal(t, uint64(1), zmqguard.Default().Stats().SubscribersDropped-before.SubscribersDropped)
	waitTopics(t, pub, 1) // the dropped peer's topics went with it
	require.Equal(t, 10, receiveWhilePublishing(t, pub, honest, 10, []byte("ok"), 10*time.Second))
}

// The topic bytes are capped as well as their number.
func TestSubscriptionBytesCapped(t *testing.T) {
	before := zmqguard.Default().Stats()
	pub, addr := bindPub(t, zmqguard.Network)
	c := rawPeer(t, addr, "SUB")
	half := strings.Repeat("a", zmqguard.MaxSubscriptionBytes/2)
	_, err := c.Write(append(subscribe(true, "1"+half[1:]), subscribe(true, "2"+half[1:])...))
	require.NoError(t, err)
	waitTopics(t, pub, 2) // exactly MaxSubscriptionBytes: kept
	requireOpen(t, c)
	_, _ = c.Write(subscribe(true, "x"))
	requireClosedByPeer(t, c)
	require.Equal(t, uint64(1), zmqguard.Default().Stats().SubscribersDropped-before.SubscribersDropped)

	// A single frame longer than any subscription within the cap is refused
	// from its header, before its body is read or allocated.
	oversized := zmqguard.Default().Stats().OversizedMessages
	c = rawPeer(t, addr, "SUB")
	_, _ = c.Write(frameHeader(0, 1<<30))
	requireClosedByPeer(t, c)
	require.Equal(t, uint64(1), zmqguard.Default().Stats().OversizedMessages-oversized)
	waitTopics(t, pub, 0)
}

// Cancelled topics no longer count: a subscriber may change its topics for as
// long as it likes.
func TestCancelledSubscriptionsFreeTheirPlace(t *testing.T) {
	pub, addr := bindPub(t, zmqguard.Network)
	c := rawPeer(t, addr, "SUB")
	for round := range 5 {
		var batch []byte
		for i := range zmqguard.MaxSubscriptions {
			batch = append(batch, subscribe(true, fmt.Sprintf("r%d-%04d", round, i))...)
		}
		_, err := c.Write(batch)
		require.NoError(t, err)
		waitTopics(t, pub, zmqguard.MaxSubscriptions)
		batch = batch[:0]
		for i := range zmqguard.MaxSubscriptions {
			batch = append(batch, subscribe(false, fmt.Sprintf("r%d-%04d", round, i))...)
		}
		_, err = c.Write(batch)
		require.NoError(t, err)
		waitTopics(t, pub, 0)
	}
	requireOpen(t, c)
}

// readMessage reads one message's frames from a raw connection.
func readMessage(t *testing.T, c net.Conn) [][]byte {
	t.Helper()
	var frames [][]byte
	for {
		hdr := make([]byte, 2)
		_, err := io.ReadFull(c, hdr)
		require.NoError(t, err)
		frame := make([]byte, hdr[1]) // short frames only in these tests
		require.Zero(t, hdr[0]&0x02)
		_, err = io.ReadFull(c, frame)
		require.NoError(t, err)
		frames = append(frames, frame)
		if hdr[0]&0x01 == 0 {
			return frames
		}
	}
}

// publishUntilReceived publishes msg on pub until c has a message to read
// (subscriptions take effect asynchronously), and returns it.
func publishUntilReceived(t *testing.T, pub zmq4.Socket, c net.Conn, msg ...[]byte) [][]byte {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		require.NoError(t, pub.Send(zmq4.NewMsgFrom(msg...)))
		require.NoError(t, c.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
		one := make([]byte, 1)
		if _, err := io.ReadFull(c, one); err == nil {
			require.NoError(t, c.SetReadDeadline(deadline))
			rest := readMessage(t, &prefixConn{Conn: c, prefix: one})
			return rest
		}
		require.True(t, time.Now().Before(deadline), "the subscriber received nothing")
	}
}

// prefixConn reads prefix before Conn.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// ZMTP 3.1 subscribers send SUBSCRIBE and CANCEL commands. zmq4's PUB
// understood only the 3.0 messages; the guard hands them over as those (and
// counts them against the caps).
func TestSubscribeCommandsAreHonoured(t *testing.T) {
	pub, addr := bindPub(t, zmqguard.Network)
	c := rawPeer(t, addr, "SUB")
	_, err := c.Write(command("SUBSCRIBE", []byte("a")))
	require.NoError(t, err)
	got := publishUntilReceived(t, pub, c, []byte("a1"), []byte("x"))
	require.Equal(t, [][]byte{[]byte("a1"), []byte("x")}, got)

	_, err = c.Write(command("CANCEL", []byte("a")))
	require.NoError(t, err)
	waitTopics(t, pub, 0)

	var batch []byte
	for i := range zmqguard.MaxSubscriptions + 1 {
		batch = append(batch, command("SUBSCRIBE", fmt.Appendf(nil, "c%d", i))...)
	}
	_, _ = c.Write(batch)
	requireClosedByPeer(t, c)
}

// zmq4's PUB queued every message from a peer that is not a subscription
// where nothing reads it; once ten were queued, each connection's reader
// that got one blocked for good, and that peer's later subscriptions were
// never seen. The guard swallows them, as libzmq's PUB ignores them.
func TestNonSubscriptionMessagesDoNotWedgePublisher(t *testing.T) {
	pub, addr := bindPub(t, zmqguard.Network)
	c := rawPeer(t, addr, "SUB")
	var junk []byte
	for i := range 20 {
		junk = append(junk, frameHeader(0, 5)...)
		junk = append(junk, fmt.Sprintf("junk%d", i%10)...)
		junk = append(junk, frameHeader(0x01, 1)...) // a multipart message
		junk = append(junk, 1)
		junk = append(junk, frameHeader(0, 0)...)
		junk = append(junk, command("PING", []byte{0, 0})...)
	}
	_, err := c.Write(junk)
	require.NoError(t, err)
	_, err = c.Write(subscribe(true, "b"))
	require.NoError(t, err)
	got := publishUntilReceived(t, pub, c, []byte("b"), bytes.Repeat([]byte{'y'}, 10))
	require.Equal(t, [][]byte{[]byte("b"), bytes.Repeat([]byte{'y'}, 10)}, got)
	require.Equal(t, []string{"b"}, pub.(zmq4.Topics).Topics())
}

// Peers of other types are not filtered: a PUSH's messages reach a PULL
// whatever their first byte.
func TestOtherPeersNotFiltered(t *testing.T) {
	pull := zmq4.NewPull(t.Context())
	defer pull.Close()
	require.NoError(t, pull.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))
	c := rawPeer(t, pull.Addr().String(), "PUSH")
	for _, first := range []byte{1, 0, 7} {
		_, err := c.Write(append(frameHeader(0, 2), first, 'z'))
		require.NoError(t, err)
		msg, err := pull.Recv()
		require.NoError(t, err)
		require.Equal(t, [][]byte{{first, 'z'}}, msg.Frames)
	}
}
