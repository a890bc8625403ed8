package zmqguard_test

import (
	"bytes"
	"context"
	"net"
	"sync/atomic"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// gatedPull binds a PULL socket whose peers must send the message "let me
// in" before more than limit bytes.
func gatedPull(t *testing.T, limit int, onDrop func(string, uint64)) (*zmqguard.Gate, zmq4.Socket, string) {
	t.Helper()
	g := &zmqguard.Gate{Limit: limit, OnDrop: onDrop, Verify: func(frames [][]byte) bool {
		return len(frames) == 1 && string(frames[0]) == "let me in"
	}}
	ctx, cancel := context.WithCancel(context.Background())
	pull := zmq4.NewPull(zmqguard.WithGate(ctx, g))
	t.Cleanup(func() { _ = pull.Close(); cancel() })
	require.NoError(t, pull.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))
	return g, pull, pull.Addr().String()
}

// A peer that has not authenticated is disconnected before zmq4 reads the
// header of a frame that would take it over the gate's limit: a 48 MiB
// message (well under the transport's 64 MiB maximum) costs the process no
// more than the limit.
func TestGateDropsUnauthenticatedPeerOverLimit(t *testing.T) {
	const limit = 1024
	var declared atomic.Uint64
	g, _, addr := gatedPull(t, limit, func(_ string, sent uint64) { declared.Store(sent) })

	c := rawPeer(t, addr, "PUSH")
	big := make([]byte, 48<<20)
	_, err := c.Write(append(frameHeader(0, uint64(len(big))), big...))
	require.Error(t, err, "the leader closed the connection instead of reading 48 MiB")
	requireClosedByPeer(t, c)

	st := g.Stats()
	require.Equal(t, uint64(1), st.Dropped)
	require.Zero(t, st.Authenticated)
	require.LessOrEqual(t, st.MaxUnauthenticatedBytes, uint64(limit))
	require.Greater(t, declared.Load(), uint64(48<<20), "the drop reports what the peer declared")
	t.Logf("bytes buffered for the peer before its drop: %d (limit %d)", st.MaxUnauthenticatedBytes, limit)
}

// Small messages that do not authenticate reach the socket (the
// application counts them as forged) but add up: the peer is dropped once
// they pass the limit.
func TestGateCountsEveryUnauthenticatedByte(t *testing.T) {
	const limit = 1024
	g, pull, addr := gatedPull(t, limit, nil)
	c := rawPeer(t, addr, "PUSH")
	msg := append(frameHeader(0, 200), bytes.Repeat([]byte{'f'}, 200)...)
	for range 3 {
		_, err := c.Write(msg)
		require.NoError(t, err)
	}
	for range 3 {
		got, err := pull.Recv()
		require.NoError(t, err)
		require.Len(t, got.Frames[0], 200)
	}
	for i := 0; i < 10; i++ {
		if _, err := c.Write(msg); err != nil {
			break
		}
	}
	requireClosedByPeer(t, c)
	require.Equal(t, uint64(1), g.Stats().Dropped)
	require.LessOrEqual(t, g.Stats().MaxUnauthenticatedBytes, uint64(limit))
}

// A peer whose message verifies is no longer held to the limit; its READY
// command counts toward the limit, and a READY over it fails the handshake.
func TestGateLetsAuthenticatedPeerThrough(t *testing.T) {
	g, pull, addr := gatedPull(t, 1024, nil)
	c := rawPeer(t, addr, "PUSH")
	_, err := c.Write(append(frameHeader(0, 9), "let me in"...))
	require.NoError(t, err)
	big := bytes.Repeat([]byte{'b'}, 2<<20)
	_, err = c.Write(append(frameHeader(0, uint64(len(big))), big...))
	require.NoError(t, err)
	for _, want := range [][]byte{[]byte("let me in"), big} {
		msg, err := pull.Recv()
		require.NoError(t, err)
		require.Equal(t, [][]byte{want}, msg.Frames)
	}
	require.Equal(t, zmqguard.GateStats{Authenticated: 1, MaxUnauthenticatedBytes: g.Stats().MaxUnauthenticatedBytes}, g.Stats())
	require.Less(t, g.Stats().MaxUnauthenticatedBytes, uint64(100), "READY and the one small message")

	// A READY command over the limit ends the handshake.
	r, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer r.Close()
	_, err = r.Write(append(greeting(), command("READY", make([]byte, 2000))...))
	require.NoError(t, err)
	requireClosedByPeer(t, r)

	// A socket of the same transport without a gate is not held.
	plain := zmq4.NewPull(context.Background())
	defer plain.Close()
	require.NoError(t, plain.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))
	p := rawPeer(t, plain.Addr().String(), "PUSH")
	_, err = p.Write(append(frameHeader(0, uint64(len(big))), big...))
	require.NoError(t, err)
	msg, err := plain.Recv()
	require.NoError(t, err)
	require.Equal(t, [][]byte{big}, msg.Frames)
}
