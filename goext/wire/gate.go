package wire

import (
	"log/slog"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// Pre-authentication caps. zmq4 reads a whole multipart message (up to
// DYN_KVBM_ZMQ_MAX_MESSAGE_MB) before the side channel can check its HMAC,
// so without a cap a peer that does not know the secret makes this process
// buffer that much per message. Each connection may carry at most this many
// bytes (after the ZMTP greeting) before one of its messages verifies; the
// peer that would send more is disconnected before zmq4 reads the header of
// the frame that would, counted and logged (zmqguard.Gate).
const (
	// maxUnauthenticatedBytes caps a peer of the leader's ack (PULL)
	// socket: anyone who can reach the port. A worker's first message is its
	// worker_metadata report: about 60 bytes of ZMTP READY command and 200
	// of sealed message. 8 KiB leaves room for that many times over, and for
	// a few messages from a worker given another secret (which the leader
	// logs as forged before the cap drops it).
	maxUnauthenticatedBytes = 8 << 10
	// maxUnauthenticatedLeaderBytes caps each of a worker's subscriptions
	// to the leader's PUB socket: a process that took the leader's port
	// could otherwise make every worker buffer its messages. The first
	// message a subscription gets is whatever the leader broadcasts next
	// (the handshake's messages, then pings), at most a background
	// operation: 34 bytes per move, under 9 KB for the 256 moves an
	// operation holds when leader.Options.MaxMovesPerStep is 0, as the C
	// API leaves it; 64 KiB covers about 1,900. A subscription whose first
	// message is larger is dropped and redialed, and that operation is
	// retried after its timeout.
	maxUnauthenticatedLeaderBytes = 64 << 10
)

// authGate holds every connection to limit bytes until a message of its
// peer verifies under s; who names this end in the log.
func authGate(s *sealer, log *slog.Logger, limit int, who string) *zmqguard.Gate {
	g := &zmqguard.Gate{
		Limit:  limit,
		Verify: func(frames [][]byte) bool { _, err := s.open(frames); return err == nil },
	}
	g.OnDrop = func(remote string, sent uint64) {
		// Logged like forged messages: the first few, then every 1000th.
		if n := g.Stats().Dropped; n <= 5 || n%1000 == 0 {
			log.Warn("kvbm "+who+" side channel: disconnected a peer that sent too much before authenticating "+
				"(a process without the engine's secret, or a leader and worker configured with different secrets)",
				"peer", remote, "bytes", sent, "limit", limit, "dropped_total", n)
		}
	}
	return g
}

// UnauthenticatedPeers returns the counters of the ack socket's gate: peers
// that authenticated, peers disconnected for sending more than
// maxUnauthenticatedBytes unauthenticated, and the most bytes one peer sent
// before either. Zero with the in-process transport.
func (l *Coordinator) UnauthenticatedPeers() zmqguard.GateStats {
	if l.gate == nil {
		return zmqguard.GateStats{}
	}
	return l.gate.Stats()
}

// UnauthenticatedPeers returns the counters of the gate on this rank's
// subscriptions to the leader (see Coordinator.UnauthenticatedPeers), with
// the cap maxUnauthenticatedLeaderBytes. Zero with the in-process transport.
func (w *Member) UnauthenticatedPeers() zmqguard.GateStats {
	if w.gate == nil {
		return zmqguard.GateStats{}
	}
	return w.gate.Stats()
}
