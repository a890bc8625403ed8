package wire

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// attacker is a raw zmq4 socket of a local process that can reach the
// side channel's ports but does not know the engine's secret.
func attackerPush(t *testing.T, ep Endpoint) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := zmq4.NewPush(ctx)
	require.NoError(t, s.Dial(ep.AckURL()))
	t.Cleanup(func() { _ = s.Close(); cancel() })
	return s
}

// TestForgedWorkerMessagesAreDropped: before the real rank 1 exists, an
// attacker reports forged metadata for it and says goodbye in its name,
// unsigned and signed with a wrong secret. The leader drops and counts
// every one; the real workers complete the handshake and nobody is dead.
func TestForgedWorkerMessagesAreDropped(t *testing.T) {
	c := newCluster(t, TransportTCP, 2)
	l := c.listen(t, func(o *CoordinatorOptions) { o.PingInterval = 50 * time.Millisecond })
	push := attackerPush(t, l.Endpoint())
	wrong := newSealer("not the engine's secret", labelToLeader, labelToWorkers)
	md := marshal(WorkerMetadata{Rank: 1, WorldSize: 2, NumDeviceBlocks: 1, BytesPerBlock: 1, Pid: 1, Instance: 99})
	forged := [][][]byte{
		encodeWorker(0, fnWorkerMetadata, 1, md),
		wrong.seal(encodeWorker(0, fnWorkerMetadata, 1, md)),
		wrong.seal(encodeWorker(0, fnBye, 1, nil)),
		encodeWorker(0, fnBye, 1, nil),
		{[]byte("x")},
	}
	// PUSH delivers once connected: keep sending until the leader counted some.
	checkFor(t, 10*time.Second, func() bool {
		for _, f := range forged {
			require.NoError(t, push.Send(zmq4.NewMsgFrom(f...)))
		}
		return l.Forged() >= uint64(len(forged))
	}, "forged messages reached the leader")

	c.connect(t, 0, nil)
	c.connect(t, 1, nil)
	hs, err := l.Handshake(ctxTimeout(t, 20*time.Second))
	require.NoError(t, err, "forged metadata must not break the handshake")
	require.Equal(t, int64(4096), hs.BytesPerBlock, "the real ranks' metadata, not the forged one")
	require.Empty(t, l.DeadRanks(), "a forged goodbye kills nobody")
	require.NoError(t, l.Broadcast(ctxTimeout(t, 10*time.Second), []byte("op")))
	require.Contains(t, c.logs.String(), "dropped an unauthenticated message")
}

// TestWorkerExecutesOnlyTheLeadersPlans: a process that bound the leader's
// ports first sends plans; the worker runs only the one signed with the
// engine's secret (which a real attacker does not have), so no forged plan
// can copy one engine block over another.
func TestWorkerExecutesOnlyTheLeadersPlans(t *testing.T) {
	c := newCluster(t, TransportTCP, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	require.NoError(t, pub.Listen(c.ep.PubURL()))
	defer pub.Close()
	pull := zmq4.NewPull(ctx)
	require.NoError(t, pull.Listen(c.ep.AckURL()))
	defer pull.Close()
	w := c.connect(t, 0, nil)
	// The worker reports its metadata once connected: it is subscribed.
	_, err := pull.Recv()
	require.NoError(t, err)

	wrong := newSealer("not the engine's secret", labelToWorkers, labelToLeader)
	right := newSealer(c.secret, labelToWorkers, labelToLeader)
	// PUB drops what it sends before the worker's subscription reaches it
	// (and while the worker redials after a silent leader), so each message
	// is repeated until its effect shows. A forged allocation request (other
	// sizes) is ignored; the signed one is answered, and allocates once.
	lm := marshal(LeaderMetadata{NumHostBlocks: 10, NumDiskBlocks: 20, WorldSize: 1})
	forgedLM := marshal(LeaderMetadata{NumHostBlocks: 666, NumDiskBlocks: 666, WorldSize: 1})
	checkFor(t, 30*time.Second, func() bool {
		require.NoError(t, pub.Send(zmq4.NewMsgFrom(wrong.seal(encodeLeader(4, fnLeaderMetadata, forgedLM))...)))
		require.NoError(t, pub.Send(zmq4.NewMsgFrom(right.seal(encodeLeader(5, fnLeaderMetadata, lm))...)))
		select {
		case <-w.Ready():
			return true
		default:
			return false
		}
	}, "the signed leader_metadata was answered")
	checkFor(t, 30*time.Second, func() bool {
		for i := range 3 {
			require.NoError(t, pub.Send(zmq4.NewMsgFrom(encodeLeader(uint64(10+i), fnStep, []byte("unsigned"))...)))
			require.NoError(t, pub.Send(zmq4.NewMsgFrom(wrong.seal(encodeLeader(uint64(20+i), fnStep, []byte("wrong key")))...)))
		}
		return w.Forged() >= 7
	}, "the forged plans reached the worker")
	// Positive control: the same kind of message, signed with the secret
	// (repeats carry the same id: the worker runs it once).
	checkFor(t, 30*time.Second, func() bool {
		require.NoError(t, pub.Send(zmq4.NewMsgFrom(right.seal(encodeLeader(30, fnStep, []byte("signed")))...)))
		return len(c.ranks[0].steps()) >= 1
	}, "the signed plan ran")
	require.Equal(t, [][]byte{[]byte("signed")}, c.ranks[0].steps(), "only the signed plan ran, once")
	require.GreaterOrEqual(t, w.Forged(), uint64(7), fmt.Sprintf("logs:\n%s", c.logs.String()))
	require.Len(t, c.ranks[0].alloc, 1, "allocated once, from the signed request")
	require.Equal(t, 10, c.ranks[0].alloc[0].NumHostBlocks, "the signed sizes, not the forged ones")
}
