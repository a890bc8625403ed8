package wire

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/zmqguard"
)

// Defaults of CoordinatorOptions.
const (
	DefaultPingInterval  = 500 * time.Millisecond
	DefaultRetryInterval = 100 * time.Millisecond
	// DefaultSuspectAfter is config.DefaultLeaderWorkerLiveness.
	DefaultSuspectAfter = config.DefaultLeaderWorkerLiveness
)

// Errors callers branch on.
var (
	// ErrRankDead: a rank's process is gone (it said goodbye, exited, or was
	// replaced); the operation did not complete on it, and no later operation
	// is sent.
	ErrRankDead = errors.New("wire: worker rank dead")
	// ErrRankSuspect: a rank stopped answering for longer than SuspectAfter;
	// nothing is sent until it answers again.
	ErrRankSuspect = errors.New("wire: worker rank not answering")
	// ErrNotReady: Broadcast before the handshake completed.
	ErrNotReady = errors.New("wire: side channel handshake not complete")
	// ErrClosed: the leader or worker end was closed.
	ErrClosed = errors.New("wire: side channel closed")
	// ErrHandshakeTimeout is wrapped by the handshake's timeout error.
	ErrHandshakeTimeout = errors.New("wire: leader/worker handshake timed out")
	// ErrHandshakePending: the caller's context ended before the handshake
	// completed and before its InitTimeout; calling Handshake again resumes
	// it (callers wait in slices to stay interruptible).
	ErrHandshakePending = errors.New("wire: leader/worker handshake still in progress")
	// errLeaderGone: the worker lost the leader (connection closed, or it
	// said shutdown).
	errLeaderGone = errors.New("wire: leader went away")
)

// DeadRanksError is returned by Broadcast when ranks are dead (it wraps
// ErrRankDead).
type DeadRanksError struct {
	Ranks []int
	// During is true when the ranks died while the operation was in flight.
	During bool
}

func (e *DeadRanksError) Error() string {
	if e.During {
		return fmt.Sprintf("wire: worker rank(s) %v stopped answering during the operation; it did not complete on them "+
			"and no further transfers are planned for them", e.Ranks)
	}
	return fmt.Sprintf("wire: worker rank(s) %v dead (stopped answering heartbeats); not sending operations that need them", e.Ranks)
}

func (e *DeadRanksError) Unwrap() error { return ErrRankDead }

// SuspectRanksError is returned by Broadcast when ranks stopped answering
// (it wraps ErrRankSuspect). Unlike death it is temporary: the ranks are
// re-admitted when they answer again.
type SuspectRanksError struct {
	Ranks []int
	// During is true when the ranks fell silent while the operation was in
	// flight; it may still run on them later, in order, before anything
	// broadcast after their return.
	During bool
}

func (e *SuspectRanksError) Error() string {
	if e.During {
		return fmt.Sprintf("wire: worker rank(s) %v stopped answering during the operation; it is failed "+
			"(it may still run there later, harmlessly)", e.Ranks)
	}
	return fmt.Sprintf("wire: worker rank(s) %v not answering heartbeats; nothing is sent until they answer again", e.Ranks)
}

func (e *SuspectRanksError) Unwrap() error { return ErrRankSuspect }

// SizeFunc sizes the host and disk tiers (blocks) from one rank's
// bytes_per_block and the number of ranks.
type SizeFunc func(bytesPerBlock int64, numWorkers int) (hostBlocks, diskBlocks int, err error)

// ConfigSize is design §2's sizing from kvbm's configuration
// (config.TierBlocks, as leader.New and every worker size them).
func ConfigSize(c *config.Config) SizeFunc {
	return func(bpb int64, n int) (int, int, error) {
		host, disk, err := c.TierBlocks(bpb, n)
		if err != nil {
			return 0, 0, fmt.Errorf("sizing for %d workers × %d bytes per block: %w", n, bpb, err) // errprefix: wrapped by the handshake's "wire: tier sizing" error
		}
		return host, disk, nil
	}
}

// CoordinatorOptions configure the leader's end.
type CoordinatorOptions struct {
	// NumWorkers is the tensor-parallel size: ranks 0..NumWorkers-1 must answer.
	NumWorkers int
	Endpoint   Endpoint
	// InProc is where the in-process transport's workers find this
	// leader (nil: the package's default registry).
	InProc    *InProcHubs
	Transport Transport
	// InitTimeout bounds Handshake (DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS);
	// 0: config.DefaultLeaderWorkerInitTimeout.
	InitTimeout time.Duration
	// Size sizes G2/G3; required (ConfigSize(cfg) in production).
	Size SizeFunc
	// PingInterval between heartbeats (0: DefaultPingInterval); a rank
	// silent for SuspectAfter (0: DefaultSuspectAfter) is suspected until it
	// answers again.
	PingInterval time.Duration
	SuspectAfter time.Duration
	// RetryInterval between repeats of unanswered handshake messages (0:
	// DefaultRetryInterval).
	RetryInterval time.Duration
	// Secret authenticates the TCP transport (auth.go); the leader and its
	// workers must be given the same one. Empty: unauthenticated (logged).
	Secret string
	Logger *slog.Logger
}

// CoordinatorOptionsFrom fills endpoint, timeout and sizing from kvbm's configuration.
func CoordinatorOptionsFrom(c *config.Config, numWorkers int) CoordinatorOptions {
	return CoordinatorOptions{
		NumWorkers:   numWorkers,
		Endpoint:     EndpointFrom(c),
		InitTimeout:  c.LeaderWorkerInitTimeout,
		SuspectAfter: c.LeaderWorkerLiveness,
		Secret:       c.LeaderWorkerSecret,
		Size:         ConfigSize(c),
	}
}

type rankState struct {
	md         *WorkerMetadata
	allocating bool
	ready      bool
	allocErr   string
	lastSeen   time.Time
	suspect    bool // silent for SuspectAfter; re-admitted when it answers
	dead       bool // its process is gone: for good
}

// Coordinator is the leader's end of the side channel. Create it with Listen,
// run Handshake once, then Broadcast operations. Safe for concurrent use.
//
// Goroutines: a receive loop (from Listen) and, after the handshake, a
// heartbeat loop; Close stops both and waits for them.
type Coordinator struct {
	opts      CoordinatorOptions
	transport Transport
	log       *slog.Logger
	t         leaderTransport
	ep        Endpoint // with the ports actually bound
	nextID    atomic.Uint64
	forged    forgeries // unauthenticated messages dropped

	// gate caps what the ack socket's peers send unauthenticated (gate.go);
	// nil in process.
	gate *zmqguard.Gate

	mu        sync.Mutex // guards everything below
	ranks     []rankState
	conflict  error // a handshake-breaking report seen by the receive loop
	meta      *LeaderMetadata
	metaID    uint64 // id of the leader_metadata broadcast
	hs        *Handshake
	hsStart   time.Time // first Handshake call
	ops       map[uint64]*op
	closedErr error

	changed chan struct{} // wakes Handshake; capacity 1
	closed  chan struct{}
	wg      sync.WaitGroup
	once    sync.Once // Close
	hbOnce  sync.Once // heartbeat start
}

// Listen binds the leader's sockets (or the in-process channel) and starts
// receiving. A taken port fails here, naming the variable to change.
func Listen(opts CoordinatorOptions) (*Coordinator, error) {
	if opts.NumWorkers < 1 {
		return nil, fmt.Errorf("wire: %d workers: need at least one", opts.NumWorkers)
	}
	if opts.Size == nil {
		return nil, errors.New("wire: CoordinatorOptions.Size is nil")
	}
	if opts.InitTimeout <= 0 {
		opts.InitTimeout = config.DefaultLeaderWorkerInitTimeout
	}
	if opts.PingInterval <= 0 {
		opts.PingInterval = DefaultPingInterval
	}
	if opts.SuspectAfter <= 0 {
		opts.SuspectAfter = DefaultSuspectAfter
	}
	if opts.RetryInterval <= 0 {
		opts.RetryInterval = DefaultRetryInterval
	}
	l := &Coordinator{
		opts:      opts,
		transport: opts.Transport.resolve(opts.NumWorkers),
		log:       opts.Logger,
		ep:        opts.Endpoint,
		ranks:     make([]rankState, opts.NumWorkers),
		ops:       make(map[uint64]*op),
		changed:   make(chan struct{}, 1),
		closed:    make(chan struct{}),
	}
	if l.log == nil {
		l.log = slog.Default()
	}
	switch l.transport {
	case TransportInProc:
		t, err := listenInProc(opts.InProc, opts.Endpoint)
		if err != nil {
			return nil, err
		}
		l.t = t
	default:
		s := newSealer(opts.Secret, labelToWorkers, labelToLeader)
		l.gate = authGate(s, l.log, maxUnauthenticatedBytes, "leader")
		t, err := listenTCP(opts.Endpoint, l.log, l.gate)
		if err != nil {
			return nil, err
		}
		l.t = sealedLeader{t, s}
		l.ep.PubPort, l.ep.AckPort = t.pubP, t.ackP
		if opts.Secret == "" {
			l.log.Warn("kvbm leader side channel is not authenticated: no secret given; any local process can " +
				"impersonate a worker (set " + config.EnvLeaderWorkerSecret + ", the same on every rank)")
		}
	}
	l.log.Info("kvbm leader side channel listening", "transport", l.transport.String(),
		"pub", l.ep.PubURL(), "ack", l.ep.AckURL(), "workers", opts.NumWorkers)
	l.wg.Add(1)
	go l.recvLoop()
	return l, nil
}

// Endpoint is where the leader listens, with the ports actually bound.
func (l *Coordinator) Endpoint() Endpoint { return l.ep }

// Transport is the transport in use (Auto resolved).
func (l *Coordinator) Transport() Transport { return l.transport }

func (l *Coordinator) signal() {
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

func (l *Coordinator) recvLoop() {
	defer l.wg.Done()
	for {
		frames, err := l.t.recv()
		if errors.Is(err, errTransportClosed) {
			return
		}
		if errors.Is(err, errForged) {
			l.forged.drop(l.log, "leader", err)
			continue
		}
		if err != nil {
			// One peer's connection dropped; the heartbeat names the rank.
			l.log.Debug("kvbm leader side channel: peer connection error", "err", err)
			continue
		}
		m, err := decodeWorker(frames)
		if err != nil {
			l.log.Warn("kvbm leader side channel: ignoring message", "err", err)
			continue
		}
		l.handle(m)
	}
}

func (l *Coordinator) handle(m workerMsg) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m.rank < 0 || m.rank >= len(l.ranks) {
		if l.hs == nil && l.conflict == nil {
			l.conflict = fmt.Errorf("wire: a worker reported rank %d, but the leader expects %d workers (ranks 0..%d); "+
				"is the engine's tensor-parallel size the same on both sides?", m.rank, len(l.ranks), len(l.ranks)-1)
			l.signal()
		} else {
			l.log.Warn("kvbm leader side channel: message from unknown rank ignored", "rank", m.rank, "function", m.fn)
		}
		return
	}
	rs := &l.ranks[m.rank]
	if rs.dead {
		return // dead for good (see the package comment)
	}
	rs.lastSeen = time.Now()
	if rs.suspect {
		rs.suspect = false
		l.log.Warn("kvbm worker rank answers again; re-admitted: transfers are planned for it again",
			"rank", m.rank, "pid", rs.pid())
	}
	switch m.fn {
	case fnWorkerMetadata:
		var md WorkerMetadata
		if err := unmarshal(m.payload, &md); err != nil {
			l.log.Warn("kvbm leader side channel: bad worker metadata", "rank", m.rank, "err", err)
			return
		}
		md.Rank = m.rank
		if rs.md != nil && rs.md.Instance != md.Instance {
			err := fmt.Errorf("wire: rank %d is reported by two worker processes (pid %d and pid %d); "+
				"two engines on this host sharing %s/%s, or a worker restarted",
				m.rank, rs.md.Pid, md.Pid, config.EnvLeaderZMQPubPort, config.EnvLeaderZMQAckPort)
			if l.hs == nil {
				if l.conflict == nil {
					l.conflict = err
					l.signal()
				}
			} else {
				l.markDeadLocked(m.rank, err.Error())
			}
			return
		}
		if rs.md == nil {
			rs.md = &md
			l.log.Debug("kvbm leader side channel: worker reported", "rank", m.rank, "pid", md.Pid,
				"num_device_blocks", md.NumDeviceBlocks, "bytes_per_block", md.BytesPerBlock)
			l.signal()
		}
	case fnBye:
		l.markGoneLocked(m.rank, "the worker closed (engine shutdown)")
	case fnAllocating:
		if m.id == l.metaID && !rs.allocating {
			rs.allocating = true
			l.signal()
		}
	case fnAck:
		if l.meta != nil && m.id == l.metaID {
			if !rs.ready && rs.allocErr == "" {
				if len(m.payload) > 0 {
					rs.allocErr = string(m.payload)
				} else {
					rs.ready = true
				}
				l.signal()
			}
			return
		}
		if o := l.ops[m.id]; o != nil {
			var err error
			if len(m.payload) > 0 {
				err = fmt.Errorf("rank %d: %s", m.rank, m.payload) // errprefix: joined into Broadcast's "wire: broadcast" error
			}
			o.settle(m.rank, err)
		}
		// Otherwise a ping's answer or an operation given up: liveness only.
	}
}

// Forged is the number of unauthenticated messages dropped.
func (l *Coordinator) Forged() uint64 { return l.forged.count() }

// Close tells the workers (best effort), stops the goroutines and releases
// the ports. Waiting Broadcasts return ErrClosed.
func (l *Coordinator) Close() error {
	var err error
	l.once.Do(func() {
		l.mu.Lock()
		l.closedErr = ErrClosed
		l.mu.Unlock()
		_ = l.t.broadcast(encodeLeader(l.nextID.Add(1), fnShutdown, nil))
		close(l.closed)
		err = l.t.close()
		l.wg.Wait()
	})
	return err
}
