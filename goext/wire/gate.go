package wire

import (
	"log/slog"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// maxUnauthenticatedBytes caps what one peer of the leader's ack (PULL)
// socket may send before one of its messages verifies. zmq4 buffers a whole
// message (up to DYN_KVBM_ZMQ_MAX_MESSAGE_MB) before the HMAC can be
// checked, so without a cap any local process could make the leader buffer
// that much per message without knowing the secret. A worker's first
// message on its connection is its worker_metadata report: about 60 bytes
// of ZMTP READY command and 200 of sealed message; 8 KiB leaves room for
// that many times over, and for a few unauthenticated messages from a worker
// given the wrong secret (the leader logs those as forged before the cap
// drops the peer). The peer that would go past it is disconnected before
// zmq4 reads the header of the frame that would.
const maxUnauthenticatedBytes = 8 << 10

// authGate holds every peer of the ack socket to maxUnauthenticatedBytes
// until a message of its verifies under s.
func authGate(s *sealer, log *slog.Logger) *zmqguard.Gate {
	g := &zmqguard.Gate{
		Limit:  maxUnauthenticatedBytes,
		Verify: func(frames [][]byte) bool { _, err := s.open(frames); return err == nil },
	}
	g.OnDrop = func(remote string, sent uint64) {
		// Logged like forged messages: the first few, then every 1000th.
		if n := g.Stats().Dropped; n <= 5 || n%1000 == 0 {
			log.Warn("kvbm leader side channel: disconnected a peer that sent too much before authenticating "+
				"(a process without the engine's secret, or a worker given another one)", "peer", remote, "bytes", sent,
				"limit", maxUnauthenticatedBytes, "dropped_total", n)
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
