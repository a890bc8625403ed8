package wire

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
)

// Authentication of the TCP side channel. Every message carries a last
// frame of 32 bytes, HMAC-SHA256 under a key derived from the secret the
// engine gives the leader and all its workers (the vLLM connector uses its
// engine instance id; DYN_KVBM_LEADER_WORKER_SECRET sets one explicitly),
// over a direction label and every other frame, each prefixed with its
// length. A message that does not verify is dropped and counted: a peer
// that can reach the ports but does not know the secret can neither
// impersonate a worker (a forged goodbye or metadata) nor the leader (a
// plan that copies one engine block over another). The in-process
// transport needs none of this.
//
// zmq4 reads a whole message before it can be checked, so a peer of the
// leader's ack socket may send at most maxUnauthenticatedBytes (a few KiB)
// before one of its messages verifies; one that tries to send more is
// disconnected, counted and logged (gate.go).
//
// Messages are not encrypted (the side channel carries block ids and
// opaque tag ids, never KV bytes, tokens, sequence hashes or request ids:
// see plan.TagRef) and not protected against replay by someone who can
// capture loopback traffic.

const macSize = sha256.Size

// errForged: a message whose authentication frame is missing or wrong.
var errForged = errors.New("wire: unauthenticated side-channel message")

// Direction labels: a leader message cannot be replayed as a worker's.
const (
	labelToWorkers = "kvbm side channel: leader to workers"
	labelToLeader  = "kvbm side channel: worker to leader"
)

// defaultSecret keys the MAC when the engine gives no secret: the wire
// format stays the same, but anyone who knows kvbm can forge messages (the
// leader and workers log that the channel is unauthenticated).
const defaultSecret = "kvbm side channel without a configured secret"

type sealer struct {
	key        []byte
	send, recv string
}

func newSealer(secret, send, recv string) *sealer {
	if secret == "" {
		secret = defaultSecret
	}
	k := sha256.Sum256([]byte("kvbm side channel key\x00" + secret))
	return &sealer{key: k[:], send: send, recv: recv}
}

func (s *sealer) mac(label string, frames [][]byte) []byte {
	h := hmac.New(sha256.New, s.key)
	h.Write([]byte(label))
	var n [8]byte
	for _, f := range frames {
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		h.Write(n[:])
		h.Write(f)
	}
	return h.Sum(nil)
}

// seal returns frames with the authentication frame appended.
func (s *sealer) seal(frames [][]byte) [][]byte {
	out := make([][]byte, len(frames), len(frames)+1)
	copy(out, frames)
	return append(out, s.mac(s.send, frames))
}

// open verifies and strips the authentication frame.
func (s *sealer) open(frames [][]byte) ([][]byte, error) {
	if len(frames) < 2 || len(frames[len(frames)-1]) != macSize {
		return nil, fmt.Errorf("%w: no authentication frame (%d frames)", errForged, len(frames))
	}
	body := frames[:len(frames)-1]
	if !hmac.Equal(frames[len(frames)-1], s.mac(s.recv, body)) {
		return nil, fmt.Errorf("%w: authentication frame does not verify (wrong secret, or forged)", errForged)
	}
	return body, nil
}

// forgeries counts dropped unauthenticated messages and logs the first few,
// then every 1000th, so a flood cannot flood the log.
type forgeries struct {
	n atomic.Uint64
}

func (f *forgeries) drop(log *slog.Logger, who string, err error) {
	n := f.n.Add(1)
	if n <= 5 || n%1000 == 0 {
		log.Warn("kvbm "+who+" side channel: dropped an unauthenticated message (a peer without the engine's secret, "+
			"or a leader and worker configured with different secrets)", "err", err, "dropped_total", n)
	}
}

func (f *forgeries) count() uint64 { return f.n.Load() }

// sealedLeader authenticates a leader transport.
type sealedLeader struct {
	leaderTransport
	s *sealer
}

func (t sealedLeader) broadcast(frames [][]byte) error {
	return t.leaderTransport.broadcast(t.s.seal(frames))
}

func (t sealedLeader) recv() ([][]byte, error) {
	frames, err := t.leaderTransport.recv()
	if err != nil {
		return nil, err
	}
	return t.s.open(frames)
}

// sealedWorker authenticates a worker transport.
type sealedWorker struct {
	workerTransport
	s *sealer
}

func (t sealedWorker) send(frames [][]byte) error {
	return t.workerTransport.send(t.s.seal(frames))
}

// redialSub passes through to a transport that can redial its subscription.
func (t sealedWorker) redialSub(installed func()) error {
	if r, ok := t.workerTransport.(subRedialer); ok {
		return r.redialSub(installed)
	}
	return nil
}

func (t sealedWorker) recv() ([][]byte, error) {
	frames, err := t.workerTransport.recv()
	if err != nil {
		return nil, err
	}
	return t.s.open(frames)
}
