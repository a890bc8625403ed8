package zmqguard_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// The attack tests below crash or hang the test binary when the sockets use
// zmq4's plain tcp:// transport: each is a defect this package guards against.

// slowNetwork is a guarded transport with short timeouts, so the tests that
// wait for a timeout stay quick.
const slowNetwork = "kvbm+tcp-test"

var slowTransport = func() *zmqguard.Transport {
	t, err := zmqguard.Register(slowNetwork, zmqguard.Limits{
		MaxMessageSize:   1 << 20,
		HandshakeTimeout: 300 * time.Millisecond,
		WriteTimeout:     200 * time.Millisecond,
	})
	if err != nil {
		panic(err)
	}
	return t
}()

func TestEndpoint(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://127.0.0.1:5557": zmqguard.Network + "://127.0.0.1:5557",
		"tcp://*:0":            zmqguard.Network + "://*:0",
		"ipc:///tmp/x":         "ipc:///tmp/x",
		"inproc://a":           "inproc://a",
	} {
		require.Equal(t, want, zmqguard.Endpoint(in), in)
	}
}

// bindPub binds a PUB socket on a loopback ephemeral port of network and
// returns it with the tcp://host:port a peer dials.
func bindPub(t *testing.T, network string) (zmq4.Socket, string) {
	t.Helper()
	pub := zmq4.NewPub(context.Background())
	t.Cleanup(func() { _ = pub.Close() })
	require.NoError(t, pub.Listen(network+"://127.0.0.1:0"))
	return pub, pub.Addr().String()
}

// dialSub connects an honest SUB to addr through network and subscribes to
// everything.
func dialSub(t *testing.T, network, addr string) zmq4.Socket {
	t.Helper()
	sub := zmq4.NewSub(context.Background(), zmq4.WithDialerMaxRetries(0))
	t.Cleanup(func() { _ = sub.Close() })
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(network+"://"+addr))
	return sub
}

// receiveWhilePublishing publishes on pub until sub has received n messages
// or the time runs out, and returns how many sub received.
func receiveWhilePublishing(t *testing.T, pub, sub zmq4.Socket, n int, payload []byte, within time.Duration) int {
	t.Helper()
	got := make(chan struct{}, n)
	go func() {
		for {
			if _, err := sub.Recv(); err != nil {
				return
			}
			select {
			case got <- struct{}{}:
			default:
			}
		}
	}()
	deadline := time.After(within)
	received := 0
	for received < n {
		// One message in flight at a time: the publisher is never far
		// ahead of the honest subscriber, so a stuck PUB shows as no
		// progress rather than as a growing queue.
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("t"), payload)))
		select {
		case <-got:
			received++
		case <-time.After(100 * time.Millisecond):
			// Subscriptions propagate asynchronously; publish again.
		case <-deadline:
			return received
		}
	}
	return received
}

// greeting is a ZMTP 3.0 NULL greeting, as libzmq and zmq4 send it.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xFF, 0x7F, 3
	copy(g[12:], "NULL")
	return g
}

// command encodes a ZMTP command frame.
func command(name string, body []byte) []byte {
	b := append([]byte{byte(len(name))}, name...)
	b = append(b, body...)
	return append(frameHeader(0x04, uint64(len(b))), b...)
}

// frameHeader encodes a frame header declaring size bytes.
func frameHeader(flags byte, size uint64) []byte {
	if size > 255 {
		h := []byte{flags | 0x02, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], size)
		return h
	}
	return []byte{flags, byte(size)}
}

// ready is a READY command announcing a socket type.
func ready(sockType string) []byte {
	var md []byte
	md = append(md, byte(len("Socket-Type")))
	md = append(md, "Socket-Type"...)
	md = binary.BigEndian.AppendUint32(md, uint32(len(sockType)))
	md = append(md, sockType...)
	return command("READY", md)
}

// rawSubscriber completes a handshake by hand as a SUB and subscribes to
// everything; what it does next is up to the test.
func rawSubscriber(t *testing.T, addr string) net.Conn {
	t.Helper()
	c := rawPeer(t, addr, "SUB")
	_, err := c.Write(append(frameHeader(0, 1), 1)) // subscribe to ""
	require.NoError(t, err)
	return c
}

// rawPeer completes a handshake by hand as a sockType socket.
func rawPeer(t *testing.T, addr, sockType string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Write(greeting())
	require.NoError(t, err)
	peer := make([]byte, 64)
	_, err = io.ReadFull(c, peer)
	require.NoError(t, err)
	require.Equal(t, byte(0xFF), peer[0])
	_, err = c.Write(ready(sockType))
	require.NoError(t, err)
	hdr := make([]byte, 2)
	_, err = io.ReadFull(c, hdr)
	require.NoError(t, err)
	_, err = io.CopyN(io.Discard, c, int64(hdr[1]))
	require.NoError(t, err)
	require.NoError(t, c.SetDeadline(time.Time{}))
	return c
}

// requireClosedByPeer reads c to its end, which must be the other side
// closing it (EOF or a reset) well before a 5 s deadline.
func requireClosedByPeer(t *testing.T, c net.Conn) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := io.Copy(io.Discard, c)
	if err != nil {
		require.ErrorIs(t, err, syscall.ECONNRESET)
	}
}

// A frame header declaring a huge body made zmq4 allocate it and
// abort the process. Every variant must leave the process up, the peer
// disconnected, and honest subscribers served.
func TestOversizedFrameDisconnectsPeer(t *testing.T) {
	before := zmqguard.Default().Stats()
	pub, addr := bindPub(t, zmqguard.Network)
	huge := uint64(1) << 62
	for _, tc := range []struct {
		name string
		send func(c net.Conn) error
	}{
		{"message after handshake", func(c net.Conn) error {
			_, err := c.Write(frameHeader(0, huge))
			return err
		}},
		{"multipart message over the limit in small frames", func(c net.Conn) error {
			big := bytes.Repeat([]byte{0}, 1<<20)
			for i := 0; i < 80; i++ {
				if _, err := c.Write(append(frameHeader(0x01, uint64(len(big))), big...)); err != nil {
					return err
				}
			}
			return nil
		}},
		{"command after handshake", func(c net.Conn) error {
			_, err := c.Write(frameHeader(0x04, huge))
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := rawSubscriber(t, addr)
			_ = tc.send(c) // the guard may cut the connection mid-write
			requireClosedByPeer(t, c)
		})
	}
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"handshake command", frameHeader(0x04, huge)},
		{"message instead of READY", frameHeader(0, huge)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("tcp", addr)
			require.NoError(t, err)
			defer c.Close()
			_, err = c.Write(append(greeting(), tc.msg...))
			require.NoError(t, err)
			requireClosedByPeer(t, c)
		})
	}
	after := zmqguard.Default().Stats()
	require.GreaterOrEqual(t, after.OversizedMessages-before.OversizedMessages, uint64(3))
	require.GreaterOrEqual(t, after.HandshakeFailures-before.HandshakeFailures, uint64(2))

	sub := dialSub(t, zmqguard.Network, addr)
	require.Equal(t, 10, receiveWhilePublishing(t, pub, sub, 10, []byte("ok"), 10*time.Second))
}

// zmq4 ran each handshake in its accept loop without a deadline,
// so one silent connection kept every later subscriber out.
func TestIdlePeerDoesNotBlockSubscriber(t *testing.T) {
	pub, addr := bindPub(t, zmqguard.Network)
	idle, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer idle.Close()
	half, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer half.Close()
	_, err = half.Write(greeting()[:10]) // a signature, then silence
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond) // both are in the accept queue first

	sub := dialSub(t, zmqguard.Network, addr)
	// Well within the 5 s handshake timeout: the idle peers block no one
	// even before they time out.
	require.Equal(t, 20, receiveWhilePublishing(t, pub, sub, 20, []byte("ok"), 3*time.Second))
}

// A silent server must not hold a dialer past the handshake timeout.
func TestDialTimesOutOnSilentServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	sub := zmq4.NewSub(context.Background(), zmq4.WithDialerMaxRetries(0))
	defer sub.Close()
	start := time.Now()
	require.Error(t, sub.Dial(slowNetwork+"://"+ln.Addr().String()))
	require.Less(t, time.Since(start), 3*time.Second)
}

// zmq4's PUB writes to each subscriber in turn, so one that stops
// reading stopped delivery to all. The guard drops it after WriteTimeout.
func TestStalledSubscriberIsDropped(t *testing.T) {
	before := slowTransport.Stats()
	pub, addr := bindPub(t, slowNetwork)
	stalled := rawSubscriber(t, addr)
	_ = stalled // never read: its kernel buffers fill, then the PUB's writes block
	sub := dialSub(t, slowNetwork, addr)

	// 400 MiB in all, far more than loopback socket buffers hold.
	payload := bytes.Repeat([]byte{'x'}, 512<<10)
	const n = 800
	require.Equal(t, n, receiveWhilePublishing(t, pub, sub, n, payload, 60*time.Second))
	require.Greater(t, slowTransport.Stats().SlowPeersDropped, before.SlowPeersDropped)
}

// kvbm's own sockets talk to each other through the guard in both
// directions, multipart messages included.
func TestPushPullThroughGuard(t *testing.T) {
	pull := zmq4.NewPull(context.Background())
	defer pull.Close()
	require.NoError(t, pull.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))
	push := zmq4.NewPush(context.Background())
	defer push.Close()
	require.NoError(t, push.Dial(zmqguard.Endpoint("tcp://"+pull.Addr().String())))
	big := bytes.Repeat([]byte{7}, 300)
	for i := 0; i < 3; i++ {
		require.NoError(t, push.SendMulti(zmq4.NewMsgFrom([]byte("a"), big, nil)))
		msg, err := pull.Recv()
		require.NoError(t, err)
		require.Equal(t, [][]byte{[]byte("a"), big, {}}, msg.Frames)
	}
}

// The maximum message size can be changed at run time (kvbm applies
// DYN_KVBM_ZMQ_MAX_MESSAGE_MB so); it holds for connections made after.
var setMaxRuns atomic.Int64

func TestSetMaxMessageSize(t *testing.T) {
	// A name per run: transports stay registered for the process (-count=N).
	name := fmt.Sprintf("kvbm+tcp-setmax%d", setMaxRuns.Add(1))
	tr, err := zmqguard.Register(name, zmqguard.Limits{})
	require.NoError(t, err)
	tr.SetMaxMessageSize(1000)
	require.Equal(t, uint64(1000), tr.Limits().MaxMessageSize)

	pull := zmq4.NewPull(context.Background())
	defer pull.Close()
	require.NoError(t, pull.Listen(name+"://127.0.0.1:0"))
	addr := pull.Addr().String()

	c := rawPeer(t, addr, "PUSH")
	_, _ = c.Write(append(frameHeader(0, 1001), make([]byte, 1001)...))
	requireClosedByPeer(t, c)
	require.Equal(t, uint64(1), tr.Stats().OversizedMessages)

	c = rawPeer(t, addr, "PUSH")
	_, err = c.Write(append(frameHeader(0, 1000), bytes.Repeat([]byte{'k'}, 1000)...))
	require.NoError(t, err)
	// zmq4's PULL reports the dropped peer's read error first.
	msg, err := pull.Recv()
	for err != nil {
		require.ErrorContains(t, err, "over the limit of 1000 bytes")
		msg, err = pull.Recv()
	}
	require.Equal(t, [][]byte{bytes.Repeat([]byte{'k'}, 1000)}, msg.Frames)
}
