package zmqguard_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// settledGoroutines counts goroutines once exiting ones have finished.
func settledGoroutines() int {
	var n int
	for range 20 {
		runtime.GC()
		n = runtime.NumGoroutine()
		time.Sleep(10 * time.Millisecond)
	}
	return n
}

// listenPub binds kvbm's PUB on a loopback ephemeral port of tr.
func listenPub(t *testing.T, tr *zmqguard.Transport, network string) (*zmqguard.Pub, string) {
	t.Helper()
	pub := tr.NewPub()
	t.Cleanup(func() { _ = pub.Close() })
	require.NoError(t, pub.Listen(network+"://127.0.0.1:0"))
	return pub, pub.Addr().String()
}

// Every zmq4 PUB leaves a goroutine behind when closed
// (TestZMQ4PubLeaksAGoroutinePerSocket); kvbm's Pub ends all of its own,
// with subscribers connected and messages queued.
func TestPubGoroutinesEndAtClose(t *testing.T) {
	const cycles = 40
	before := settledGoroutines()
	for range cycles {
		pub := zmqguard.NewPub()
		require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
		c := rawSubscriber(t, pub.Addr().String())
		got := publishUntilReceived(t, pub, c, []byte("t"), []byte("x"))
		require.Equal(t, [][]byte{[]byte("t"), []byte("x")}, got)
		for range 100 {
			require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("t"), bytes.Repeat([]byte{'q'}, 4096))))
		}
		require.NoError(t, pub.Close())
		_ = c.Close()
	}
	leaked := settledGoroutines() - before
	require.LessOrEqual(t, leaked, 2, "goroutines left by %d closed PUB sockets", cycles)
}

// kvbm's Pub speaks to zmq4's SUB as zmq4's PUB does: multipart messages,
// long frames, prefix-matched topics.
func TestPubToZMQ4Subscribers(t *testing.T) {
	pub, addr := listenPub(t, zmqguard.Default(), "tcp")
	all := dialSub(t, zmqguard.Network, addr)
	onlyA := zmq4.NewSub(context.Background(), zmq4.WithDialerMaxRetries(0))
	defer onlyA.Close()
	require.NoError(t, onlyA.SetOption(zmq4.OptionSubscribe, "a"))
	require.NoError(t, onlyA.Dial(zmqguard.Endpoint("tcp://"+addr)))
	require.Eventually(t, func() bool { return len(pub.Topics()) == 2 }, 5*time.Second, 5*time.Millisecond)
	require.Equal(t, []string{"", "a"}, pub.Topics())

	long := bytes.Repeat([]byte{'L'}, 1000)
	require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("b1"), []byte("short"))))
	require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte("a1"), long, nil)))
	msg, err := all.Recv()
	require.NoError(t, err)
	require.Equal(t, [][]byte{[]byte("b1"), []byte("short")}, msg.Frames)
	msg, err = all.Recv()
	require.NoError(t, err)
	require.Equal(t, [][]byte{[]byte("a1"), long, {}}, msg.Frames)
	msg, err = onlyA.Recv()
	require.NoError(t, err)
	require.Equal(t, [][]byte{[]byte("a1"), long, {}}, msg.Frames)
}

// The subscription caps hold on kvbm's Pub, and a stalled subscriber is
// dropped without holding up an honest one.
func TestPubSubscriptionFloodAndStall(t *testing.T) {
	before := slowTransport.Stats()
	pub, addr := listenPub(t, slowTransport, slowNetwork)
	honest := dialSub(t, slowNetwork, addr)
	// The stalled peer subscribes to "t" (the messages' topic), so the
	// Pub's topics show when its subscription is registered: publishing must
	// not start before, or nothing is ever queued for it.
	stalled := rawPeer(t, addr, "SUB")
	_, err := stalled.Write(append(frameHeader(0, 2), 1, 't'))
	require.NoError(t, err) // never read
	require.Eventually(t, func() bool { return len(pub.Topics()) == 2 }, 5*time.Second, 5*time.Millisecond)

	flood := rawPeer(t, addr, "SUB")
	var batch []byte
	for i := range 5000 {
		batch = append(batch, subscribe(true, string(rune('A'+i%26))+string(bytes.Repeat([]byte{'f'}, i%300)))...)
	}
	_, _ = flood.Write(batch)
	requireClosedByPeer(t, flood)
	require.Equal(t, uint64(1), slowTransport.Stats().SubscribersDropped-before.SubscribersDropped)
	require.Eventually(t, func() bool { return len(pub.Topics()) == 2 }, 5*time.Second, 5*time.Millisecond)

	payload := bytes.Repeat([]byte{'x'}, 512<<10)
	const n = 128 // 64 MiB, far more than loopback socket buffers hold
	require.Equal(t, n, receiveWhilePublishing(t, pub, honest, n, payload, 60*time.Second))
	// Send never blocks, so the honest subscriber may have everything before
	// the stalled one's write times out; the drop follows within WriteTimeout.
	require.Eventually(t, func() bool { return slowTransport.Stats().SlowPeersDropped > before.SlowPeersDropped },
		30*time.Second, 10*time.Millisecond)
}

// A peer that is not a subscriber is refused, as zmq4's PUB refuses it.
func TestPubRefusesOtherPeers(t *testing.T) {
	_, addr := listenPub(t, zmqguard.Default(), "tcp")
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(append(greeting(), ready("PULL")...))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	got, err := io.ReadAll(c) // the guard's greeting, then the end
	if err != nil {
		require.ErrorIs(t, err, syscall.ECONNRESET)
	}
	require.LessOrEqual(t, len(got), 64, "a READY command for a PULL peer")
}
