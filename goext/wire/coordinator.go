package wire

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
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
	Transport  Transport
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

// Handshake is the outcome of a completed handshake.
type Handshake struct {
	NumWorkers      int
	BytesPerBlock   int64 // one rank's share of a block (leader.Options.BytesPerBlock)
	NumDeviceBlocks int
	NumHostBlocks   int
	NumDiskBlocks   int
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

// op is one broadcast waiting for its acks.
type op struct {
	waiting []bool // by rank
	left    int
	errs    []error // by rank
	dead    []int   // ranks that died while it was in flight
	suspect []int   // ranks that fell silent while it was in flight
	done    chan struct{}
}

func (o *op) settle(rank int, err error) {
	if !o.waiting[rank] {
		return
	}
	o.waiting[rank] = false
	o.errs[rank] = err
	o.left--
	if o.left == 0 {
		close(o.done)
	}
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
		t, err := listenInProc(opts.Endpoint)
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

// Handshake runs the start-up protocol (package comment) and returns the
// sizes once every rank allocated. It is bounded by InitTimeout and ctx.
// Calling it again returns the same result (or the same failure).
func (l *Coordinator) Handshake(ctx context.Context) (Handshake, error) {
	l.mu.Lock()
	closed := l.closedErr != nil
	l.mu.Unlock()
	if closed {
		return Handshake{}, ErrClosed
	}
	// InitTimeout bounds the handshake as a whole, across calls.
	l.mu.Lock()
	if l.hsStart.IsZero() {
		l.hsStart = time.Now()
	}
	start := l.hsStart
	l.mu.Unlock()
	deadline := start.Add(l.opts.InitTimeout)
	caller := ctx
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	tick := time.NewTicker(l.opts.RetryInterval)
	defer tick.Stop()
	for {
		frames, hs, err := l.handshakeStep()
		if err != nil {
			return Handshake{}, err
		}
		if hs != nil {
			l.hbOnce.Do(func() {
				l.log.Info("ZMQ handshake complete; workers allocation ready", "workers", hs.NumWorkers,
					"bytes_per_block", hs.BytesPerBlock, "num_device_blocks", hs.NumDeviceBlocks,
					"host_blocks", hs.NumHostBlocks, "disk_blocks", hs.NumDiskBlocks, "took", time.Since(start).Round(time.Millisecond))
				l.wg.Add(1)
				go l.heartbeat()
			})
			return *hs, nil
		}
		if err := l.t.broadcast(frames); err != nil && !errors.Is(err, errTransportClosed) {
			l.log.Debug("kvbm leader side channel: handshake send", "err", err)
		}
		select {
		case <-ctx.Done():
			if caller.Err() != nil && time.Now().Before(deadline) {
				return Handshake{}, fmt.Errorf("%w (%s so far)", ErrHandshakePending,
					time.Since(start).Round(time.Millisecond))
			}
			return Handshake{}, l.timeoutError(ctx, time.Since(start))
		case <-l.closed:
			return Handshake{}, ErrClosed
		case <-tick.C:
		case <-l.changed:
		}
	}
}

// handshakeStep advances the handshake: the message to (re)send, or the
// result once every rank is ready, or a fatal error.
func (l *Coordinator) handshakeStep() ([][]byte, *Handshake, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.hs != nil {
		return nil, l.hs, nil
	}
	if l.conflict != nil {
		return nil, nil, l.conflict
	}
	for _, rs := range l.ranks {
		if rs.md == nil {
			return encodeLeader(l.nextID.Add(1), fnWorkerMetadata, nil), nil, nil
		}
	}
	if l.meta == nil {
		if err := l.checkAgreement(); err != nil {
			l.conflict = err
			return nil, nil, err
		}
		md := l.ranks[0].md
		host, disk, err := l.opts.Size(md.BytesPerBlock, len(l.ranks))
		if err != nil {
			l.conflict = fmt.Errorf("wire: tier sizing: %w", err)
			return nil, nil, l.conflict
		}
		l.meta = &LeaderMetadata{NumHostBlocks: host, NumDiskBlocks: disk, WorldSize: len(l.ranks)}
		l.metaID = l.nextID.Add(1)
		l.log.Info("kvbm leader: all workers reported; asking them to allocate", "workers", len(l.ranks),
			"bytes_per_block", md.BytesPerBlock, "host_blocks", host, "disk_blocks", disk)
	}
	var failed []string
	all := true
	for r, rs := range l.ranks {
		if rs.allocErr != "" {
			// The rank's own error starts with this package's prefix too.
			failed = append(failed, fmt.Sprintf("rank %d: %s", r, strings.TrimPrefix(rs.allocErr, "wire: ")))
		}
		all = all && rs.ready
	}
	if len(failed) > 0 {
		l.conflict = fmt.Errorf("wire: worker allocation failed: %s", strings.Join(failed, "; "))
		return nil, nil, l.conflict
	}
	if all {
		md := l.ranks[0].md
		l.hs = &Handshake{NumWorkers: len(l.ranks), BytesPerBlock: md.BytesPerBlock, NumDeviceBlocks: md.NumDeviceBlocks,
			NumHostBlocks: l.meta.NumHostBlocks, NumDiskBlocks: l.meta.NumDiskBlocks}
		now := time.Now()
		for r := range l.ranks {
			l.ranks[r].lastSeen = now // the heartbeat clock starts now
		}
		return nil, l.hs, nil
	}
	return encodeLeader(l.metaID, fnLeaderMetadata, marshal(l.meta)), nil, nil
}

// checkAgreement: every rank must describe the same shard geometry.
func (l *Coordinator) checkAgreement() error {
	first := l.ranks[0].md
	var errs []string
	for r, rs := range l.ranks {
		md := rs.md
		if md.WorldSize != len(l.ranks) {
			errs = append(errs, fmt.Sprintf("rank %d was started with world size %d, the leader expects %d", r, md.WorldSize, len(l.ranks)))
		}
		if md.BytesPerBlock != first.BytesPerBlock {
			errs = append(errs, fmt.Sprintf("rank %d reports bytes_per_block %d, rank 0 reports %d", r, md.BytesPerBlock, first.BytesPerBlock))
		}
		if md.NumDeviceBlocks != first.NumDeviceBlocks {
			errs = append(errs, fmt.Sprintf("rank %d reports num_device_blocks %d, rank 0 reports %d", r, md.NumDeviceBlocks, first.NumDeviceBlocks))
		}
		if md.BytesPerBlock <= 0 {
			errs = append(errs, fmt.Sprintf("rank %d reports bytes_per_block %d", r, md.BytesPerBlock))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("wire: workers disagree (every tensor-parallel rank must hold an equal shard of the same KV cache): %s",
			strings.Join(errs, "; "))
	}
	return nil
}

func (l *Coordinator) timeoutError(ctx context.Context, waited time.Duration) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var silent, allocating, notAcked []int
	for r, rs := range l.ranks {
		switch {
		case rs.md == nil:
			silent = append(silent, r)
		case l.meta != nil && !rs.ready && rs.allocating:
			allocating = append(allocating, r)
		case l.meta != nil && !rs.ready:
			notAcked = append(notAcked, r)
		}
	}
	var parts []string
	if len(silent) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v of %d never answered", silent, len(l.ranks)))
	}
	if len(notAcked) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v reported but never acknowledged the tier sizes", notAcked))
	}
	if len(allocating) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v were still allocating their host/disk tiers", allocating))
	}
	why := "timed out"
	if ctx.Err() == context.Canceled {
		why = "cancelled"
	}
	return fmt.Errorf("%w (%s after %s; %s=%s): %s (transport %s, %s / %s)",
		ErrHandshakeTimeout, why, waited.Round(time.Millisecond), config.EnvLeaderWorkerInitTimeoutSecs,
		l.opts.InitTimeout, strings.Join(parts, "; "), l.transport, l.ep.PubURL(), l.ep.AckURL())
}

// heartbeat pings every PingInterval, suspects ranks silent for
// SuspectAfter and marks dead those whose process is gone. It stops when
// every rank is dead. Pings keep going to suspected ranks: a stopped
// process finds them queued when it resumes and its answer re-admits it
// (a handful of small messages per second fills no socket buffer).
func (l *Coordinator) heartbeat() {
	defer l.wg.Done()
	tick := time.NewTicker(l.opts.PingInterval)
	defer tick.Stop()
	for {
		select {
		case <-l.closed:
			return
		case <-tick.C:
		}
		if err := l.t.broadcast(encodeLeader(l.nextID.Add(1), fnPing, nil)); err != nil && !errors.Is(err, errTransportClosed) {
			l.log.Debug("kvbm leader side channel: ping send", "err", err)
		}
		now := time.Now()
		l.mu.Lock()
		alive := 0
		for r := range l.ranks {
			rs := &l.ranks[r]
			switch {
			case rs.dead:
				continue
			case rs.md != nil && processGone(rs.md.Pid, rs.md.PidNS):
				l.markDeadLocked(r, fmt.Sprintf("process %d exited", rs.md.Pid))
				continue
			case !rs.suspect && now.Sub(rs.lastSeen) > l.opts.SuspectAfter:
				l.suspectLocked(r, now.Sub(rs.lastSeen))
			}
			alive++
		}
		l.mu.Unlock()
		if alive == 0 {
			return
		}
	}
}

// suspectLocked stops planning for a silent rank; operations waiting on it
// fail with a *SuspectRanksError.
func (l *Coordinator) suspectLocked(rank int, silent time.Duration) {
	rs := &l.ranks[rank]
	rs.suspect = true
	l.log.Warn("kvbm worker rank not answering; suspected: no transfers are planned for it until it answers again "+
		"(the engine keeps serving)", "rank", rank, "pid", rs.pid(), "silent", silent.Round(time.Millisecond),
		"timeout", l.opts.SuspectAfter, "variable", config.EnvLeaderWorkerLivenessSecs)
	for _, o := range l.ops {
		if o.waiting[rank] {
			o.suspect = append(o.suspect, rank)
			o.settle(rank, nil)
		}
	}
}

func (rs *rankState) pid() int {
	if rs.md == nil {
		return 0
	}
	return rs.md.Pid
}

func (l *Coordinator) markDeadLocked(rank int, why string) {
	l.markRankLocked(rank, why, false)
}

// markGoneLocked is markDeadLocked for a worker that said goodbye: the same
// consequences, logged as a departure rather than a failure.
func (l *Coordinator) markGoneLocked(rank int, why string) {
	l.markRankLocked(rank, why, true)
}

func (l *Coordinator) markRankLocked(rank int, why string, left bool) {
	rs := &l.ranks[rank]
	if rs.dead {
		return
	}
	rs.dead = true
	if left {
		l.log.Info("kvbm worker rank closed; no more transfers are planned for it", "rank", rank, "pid", rs.pid(), "why", why)
	} else {
		l.log.Error("kvbm worker rank is gone; marked dead: transfers that need it are no longer planned, "+
			"the engine keeps serving (misses recompute)", "rank", rank, "pid", rs.pid(), "why", why)
	}
	for _, o := range l.ops {
		if o.waiting[rank] {
			o.dead = append(o.dead, rank)
			o.settle(rank, nil)
		}
	}
}

// SuspectRanks lists the ranks suspected (silent, not known dead), in order.
func (l *Coordinator) SuspectRanks() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.suspectedLocked()
}

func (l *Coordinator) suspectedLocked() []int {
	var d []int
	for r, rs := range l.ranks {
		if rs.suspect && !rs.dead {
			d = append(d, r)
		}
	}
	return d
}

// Forged is the number of unauthenticated messages dropped.
func (l *Coordinator) Forged() uint64 { return l.forged.count() }

// DeadRanks lists the ranks marked dead, in order.
func (l *Coordinator) DeadRanks() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deadLocked()
}

func (l *Coordinator) deadLocked() []int {
	var d []int
	for r, rs := range l.ranks {
		if rs.dead {
			d = append(d, r)
		}
	}
	return d
}

// Healthy reports whether the handshake completed and every rank is
// answering: whether operations can be planned now.
func (l *Coordinator) Healthy() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.hs != nil && l.closedErr == nil && len(l.deadLocked()) == 0 && len(l.suspectedLocked()) == 0
}

// Broadcast sends an encoded plan.Step to every rank and returns when every
// rank acked it: nil if all executed it, else an error naming each rank that
// failed (a *DeadRanksError wrapping ErrRankDead for ranks that died in
// flight). With a dead rank it returns a *DeadRanksError at once, sending
// nothing. ctx bounds the wait; on expiry the error names the ranks that had
// not answered.
func (l *Coordinator) Broadcast(ctx context.Context, step []byte) error {
	l.mu.Lock()
	switch {
	case l.closedErr != nil:
		l.mu.Unlock()
		return ErrClosed
	case l.hs == nil:
		l.mu.Unlock()
		return fmt.Errorf("%w: cannot broadcast", ErrNotReady)
	}
	if dead := l.deadLocked(); len(dead) > 0 {
		l.mu.Unlock()
		return &DeadRanksError{Ranks: dead}
	}
	if sus := l.suspectedLocked(); len(sus) > 0 {
		l.mu.Unlock()
		return &SuspectRanksError{Ranks: sus}
	}
	id := l.nextID.Add(1)
	n := len(l.ranks)
	o := &op{waiting: make([]bool, n), left: n, errs: make([]error, n), done: make(chan struct{})}
	for r := range o.waiting {
		o.waiting[r] = true
	}
	l.ops[id] = o
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.ops, id)
		l.mu.Unlock()
	}()

	if err := l.t.broadcast(encodeLeader(id, fnStep, step)); err != nil {
		if errors.Is(err, errTransportClosed) {
			return ErrClosed
		}
		return fmt.Errorf("wire: broadcast %d: send: %w", id, err)
	}
	select {
	case <-o.done:
	case <-l.closed:
		return ErrClosed
	case <-ctx.Done():
		l.mu.Lock()
		var pending []int
		for r, w := range o.waiting {
			if w {
				pending = append(pending, r)
			}
		}
		l.mu.Unlock()
		return fmt.Errorf("wire: broadcast %d: rank(s) %v did not answer: %w", id, pending, ctx.Err())
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []error
	if len(o.dead) > 0 {
		slices.Sort(o.dead)
		errs = append(errs, &DeadRanksError{Ranks: o.dead, During: true})
	}
	if len(o.suspect) > 0 {
		slices.Sort(o.suspect)
		errs = append(errs, &SuspectRanksError{Ranks: o.suspect, During: true})
	}
	for _, e := range o.errs {
		if e != nil {
			errs = append(errs, e)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("wire: broadcast %d: %w", id, errors.Join(errs...))
	}
	return nil
}

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
