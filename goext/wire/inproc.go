package wire

import (
	"bytes"
	"fmt"
	"sync"

	"github.com/kvbm/kvbm/goext/config"
)

// In-process transport: one hub per endpoint, found through a process-wide
// registry so that a leader and a worker created independently (vLLM's
// scheduler-side and worker-side connector objects) meet without passing
// anything to each other. Whichever comes first creates the hub.
//
// Semantics match the TCP pair closely enough to run the same protocol:
// leader messages fan out to every attached worker, worker messages queue
// for the leader (also before it binds, like a PUSH socket that connected
// early would not; harmless since every handshake message is repeated).

// InProcHubs is a registry of in-process hubs: a leader and workers meet
// only through the same one. goext/node's Registry holds the process's;
// options that name none use defaultHubs.
type InProcHubs struct {
	mu sync.Mutex
	m  map[string]*hub
}

// NewInProcHubs returns an empty hub registry.
func NewInProcHubs() *InProcHubs { return &InProcHubs{m: make(map[string]*hub)} }

// defaultHubs serves options without InProc (code built without goext/node).
var defaultHubs = NewInProcHubs()

func hubsOr(h *InProcHubs) *InProcHubs {
	if h == nil {
		return defaultHubs
	}
	return h
}

// Channel depths: far above what the protocol has outstanding (a handful of
// handshake messages, one ping, the operations in flight).
const (
	inprocUpDepth   = 4096
	inprocDownDepth = 1024
)

type hub struct {
	key   string
	owner *InProcHubs
	up    chan [][]byte // workers → leader

	mu    sync.Mutex // guards bound, subs
	bound bool
	subs  map[*inprocWorker]struct{}
	gone  chan struct{} // closed when the bound leader closes
}

func (hs *InProcHubs) hubFor(key string) *hub {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	h := hs.m[key]
	if h == nil {
		h = &hub{key: key, owner: hs, up: make(chan [][]byte, inprocUpDepth), subs: make(map[*inprocWorker]struct{}), gone: make(chan struct{})}
		hs.m[key] = h
	}
	return h
}

type inprocLeader struct {
	h      *hub
	closed chan struct{}
	once   sync.Once
}

func listenInProc(hs *InProcHubs, ep Endpoint) (*inprocLeader, error) {
	h := hubsOr(hs).hubFor(ep.inprocKey())
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.bound {
		return nil, fmt.Errorf("wire: the in-process side channel for %s:%d/%d is already held by another leader in this process: %w; "+
			"give each engine its own %s and %s", ep.host(), ep.PubPort, ep.AckPort, ErrPortInUse,
			config.EnvLeaderZMQPubPort, config.EnvLeaderZMQAckPort)
	}
	h.bound = true
	return &inprocLeader{h: h, closed: make(chan struct{})}, nil
}

func cloneFrames(frames [][]byte) [][]byte {
	out := make([][]byte, len(frames))
	for i, f := range frames {
		out[i] = bytes.Clone(f)
	}
	return out
}

func (t *inprocLeader) broadcast(frames [][]byte) error {
	select {
	case <-t.closed:
		return errTransportClosed
	default:
	}
	// The caller may reuse its buffers once Broadcast returns; a worker
	// may still be reading them.
	frames = cloneFrames(frames)
	t.h.mu.Lock()
	subs := make([]*inprocWorker, 0, len(t.h.subs))
	for w := range t.h.subs {
		subs = append(subs, w)
	}
	t.h.mu.Unlock()
	for _, w := range subs {
		select {
		case w.down <- frames:
		case <-w.closed:
		case <-t.closed:
			return errTransportClosed
		}
	}
	return nil
}

func (t *inprocLeader) recv() ([][]byte, error) {
	select {
	case f := <-t.h.up:
		return f, nil
	case <-t.closed:
		return nil, errTransportClosed
	}
}

func (t *inprocLeader) close() error {
	t.once.Do(func() {
		close(t.closed)
		hs := t.h.owner
		hs.mu.Lock()
		if hs.m[t.h.key] == t.h {
			delete(hs.m, t.h.key)
		}
		hs.mu.Unlock()
		close(t.h.gone)
	})
	return nil
}

type inprocWorker struct {
	h      *hub
	down   chan [][]byte
	closed chan struct{}
	once   sync.Once
}

func dialInProc(hs *InProcHubs, ep Endpoint) *inprocWorker {
	h := hubsOr(hs).hubFor(ep.inprocKey())
	w := &inprocWorker{h: h, down: make(chan [][]byte, inprocDownDepth), closed: make(chan struct{})}
	h.mu.Lock()
	h.subs[w] = struct{}{}
	h.mu.Unlock()
	return w
}

func (t *inprocWorker) send(frames [][]byte) error {
	frames = cloneFrames(frames)
	select {
	case t.h.up <- frames:
		return nil
	case <-t.h.gone:
		return errLeaderGone
	case <-t.closed:
		return errTransportClosed
	}
}

func (t *inprocWorker) recv() ([][]byte, error) {
	select {
	case f := <-t.down:
		return f, nil
	case <-t.h.gone:
		return nil, errLeaderGone
	case <-t.closed:
		return nil, errTransportClosed
	}
}

func (t *inprocWorker) close() error {
	t.once.Do(func() {
		close(t.closed)
		t.h.mu.Lock()
		delete(t.h.subs, t)
		t.h.mu.Unlock()
	})
	return nil
}
