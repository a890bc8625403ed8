package wire

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// MemberOptions configure one rank's end of the side channel.
type MemberOptions struct {
	Rank      int
	WorldSize int
	// InProc is where the in-process transport finds the leader (nil: the
	// package's default registry); the leader's CoordinatorOptions.InProc.
	InProc *InProcHubs
	// What this rank reports in the handshake: its G1 block count and its
	// share of one block (layout.Engine.BytesPerBlock).
	NumDeviceBlocks int
	BytesPerBlock   int64
	Endpoint        Endpoint
	Transport       Transport
	// Allocate is called once, on its own goroutine, with the leader's tier
	// sizes; the leader counts the rank ready when it returns nil. An error
	// is reported to the leader, which fails the handshake naming the rank.
	Allocate func(LeaderMetadata) error
	// Execute runs one broadcast operation (an encoded plan.Step). Calls are
	// sequential, in the order the leader sent them; the returned error
	// travels back in the ack. ctx ends when Close is called: an operation
	// still waiting (for the engine step it follows) must then return, as
	// Close waits for it.
	Execute func(ctx context.Context, step []byte) error
	// RetryInterval between connection attempts while the leader is not up
	// (0: DefaultRetryInterval).
	RetryInterval time.Duration
	// Secret authenticates the TCP transport: the leader's (auth.go).
	Secret string
	// LeaderSilence: over TCP, a worker that hears nothing from the leader
	// for this long (the leader pings every PingInterval) redials its
	// subscription, so that a connection the leader dropped (a worker that
	// stalled past the leader's write timeout) is replaced; the leader
	// re-admits the rank on its next answer. 0: DefaultLeaderSilence.
	LeaderSilence time.Duration
	Logger        *slog.Logger
}

// DefaultLeaderSilence is MemberOptions.LeaderSilence's default: several
// leader pings (DefaultPingInterval), well below the leader's suspicion
// timeout (DefaultSuspectAfter).
const DefaultLeaderSilence = 3 * time.Second

// subRedialer is a worker transport whose subscription can be redialed.
// redialSub calls installed (when not nil) once the new subscription is
// connected, just before anything can be received on it, so that what the
// caller records of the redial precedes every message it brings.
type subRedialer interface {
	redialSub(installed func()) error
}

// Member is one rank's end of the side channel. Connect starts it in the
// background: it returns at once (vLLM registers the KV caches on every
// worker before the scheduler, and so the leader, exists).
//
// Goroutines: a run loop (connect, receive, answer) and an executor that
// runs operations in order; Close stops both and waits for them.
type Member struct {
	opts     MemberOptions
	log      *slog.Logger
	instance uint64
	forged   forgeries // unauthenticated messages dropped

	// gate caps what a SUB connection takes before the leader authenticates
	// (gate.go); nil in process.
	gate *zmqguard.Gate

	lastHeard  atomic.Int64  // UnixNano of the last authentic leader message (or of the last redial)
	reconnects atomic.Uint64 // subscriptions redialed after leader silence

	stop  chan struct{} // closed by Close
	done  chan struct{} // closed when the run loop ended
	ready chan struct{} // closed when Allocate succeeded
	exec  chan leaderMsg
	wg    sync.WaitGroup
	once  sync.Once

	// execCtx is Execute's context, cancelled by Close (with stop).
	execCtx    context.Context
	execCancel context.CancelFunc

	mu        sync.Mutex // guards everything below
	t         workerTransport
	meta      *LeaderMetadata
	allocDone bool
	allocErr  error
	lastOp    uint64 // highest operation id queued (duplicates are dropped)
	err       error  // why the run loop ended
}

// Connect validates opts and starts connecting in the background.
func Connect(opts MemberOptions) (*Member, error) {
	if opts.WorldSize < 1 || opts.Rank < 0 || opts.Rank >= opts.WorldSize {
		return nil, fmt.Errorf("wire: rank %d of world size %d: want 0 ≤ rank < world size", opts.Rank, opts.WorldSize)
	}
	if opts.BytesPerBlock <= 0 {
		return nil, fmt.Errorf("wire: rank %d: bytes_per_block %d: must be positive", opts.Rank, opts.BytesPerBlock)
	}
	if opts.Allocate == nil || opts.Execute == nil {
		return nil, fmt.Errorf("wire: rank %d: Allocate and Execute are required", opts.Rank)
	}
	if opts.RetryInterval <= 0 {
		opts.RetryInterval = DefaultRetryInterval
	}
	if opts.LeaderSilence <= 0 {
		opts.LeaderSilence = DefaultLeaderSilence
	}
	w := &Member{
		opts:     opts,
		log:      opts.Logger,
		instance: rand.Uint64() | 1,
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		ready:    make(chan struct{}),
		exec:     make(chan leaderMsg, 1024),
	}
	w.execCtx, w.execCancel = context.WithCancel(context.Background())
	if w.log == nil {
		w.log = slog.Default()
	}
	if opts.Transport.resolve(opts.WorldSize) != TransportInProc {
		w.gate = authGate(newSealer(opts.Secret, labelToLeader, labelToWorkers), w.log, maxUnauthenticatedLeaderBytes, "worker")
	}
	w.log = w.log.With("rank", opts.Rank)
	w.wg.Add(2)
	go w.run()
	go w.executor()
	return w, nil
}

// Ready is closed once this rank allocated its tiers for the leader.
func (w *Member) Ready() <-chan struct{} { return w.ready }

// Done is closed when the worker stopped: Close, or the leader went away
// (Err says which).
func (w *Member) Done() <-chan struct{} { return w.done }

// Err is why the worker stopped (nil while running).
func (w *Member) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// WaitReady blocks until the handshake allocated this rank's tiers and
// returns the leader's sizes, or the allocation error, or ctx's.
func (w *Member) WaitReady(ctx context.Context) (LeaderMetadata, error) {
	select {
	case <-w.ready:
		w.mu.Lock()
		defer w.mu.Unlock()
		return *w.meta, nil
	case <-w.done:
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.allocErr != nil {
			return LeaderMetadata{}, w.allocErr
		}
		return LeaderMetadata{}, fmt.Errorf("wire: rank %d: side channel stopped before the handshake: %w", w.opts.Rank, w.err)
	case <-ctx.Done():
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.allocErr != nil {
			return LeaderMetadata{}, w.allocErr
		}
		return LeaderMetadata{}, fmt.Errorf("wire: rank %d: waiting for the leader's handshake (%s): %w",
			w.opts.Rank, w.opts.Endpoint.PubURL(), ctx.Err())
	}
}

func (w *Member) metadata() []byte {
	return marshal(WorkerMetadata{
		Rank: w.opts.Rank, WorldSize: w.opts.WorldSize, NumDeviceBlocks: w.opts.NumDeviceBlocks,
		BytesPerBlock: w.opts.BytesPerBlock, Pid: os.Getpid(), Instance: w.instance, PidNS: ownPidNS,
	})
}

func (w *Member) send(id uint64, fn string, payload []byte) {
	w.mu.Lock()
	t := w.t
	w.mu.Unlock()
	if t == nil {
		return
	}
	if err := t.send(encodeWorker(id, fn, w.opts.Rank, payload)); err != nil && !errors.Is(err, errTransportClosed) {
		w.log.Debug("kvbm worker side channel: send", "function", fn, "err", err)
	}
}

func (w *Member) finish(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	w.mu.Unlock()
}

func (w *Member) run() {
	defer w.wg.Done()
	defer close(w.done)
	var t workerTransport
	tr := w.opts.Transport.resolve(w.opts.WorldSize)
	if tr == TransportInProc {
		t = dialInProc(w.opts.InProc, w.opts.Endpoint)
	} else {
		tt, err := dialTCP(w.opts.Endpoint, w.opts.RetryInterval, w.stop, w.log, w.gate)
		if err != nil {
			w.finish(ErrClosed)
			return
		}
		t = sealedWorker{tt, newSealer(w.opts.Secret, labelToLeader, labelToWorkers)}
	}
	w.mu.Lock()
	w.t = t
	w.mu.Unlock()
	defer t.close()
	// Close may have run between the dial and the assignment above, seeing
	// no transport to close.
	select {
	case <-w.stop:
		w.finish(ErrClosed)
		return
	default:
	}
	w.log.Debug("kvbm worker side channel connected", "transport", tr.String(), "pub", w.opts.Endpoint.PubURL())
	w.lastHeard.Store(time.Now().UnixNano())
	if r, ok := t.(subRedialer); ok {
		ended := make(chan struct{})
		defer close(ended)
		w.wg.Add(1)
		go w.watchLeader(r, ended)
	}
	// Report at once: the leader may already be waiting. PUSH delivery is
	// reliable once connected; the leader's periodic request covers the rest.
	w.send(0, fnWorkerMetadata, w.metadata())
	for {
		frames, err := t.recv()
		if errors.Is(err, errForged) {
			w.forged.drop(w.log, "worker", err)
			continue
		}
		if err != nil {
			select {
			case <-w.stop:
				w.finish(ErrClosed)
				return
			default:
			}
			if r, ok := t.(subRedialer); ok && !errors.Is(err, errTransportClosed) {
				// The connection went away but the leader said no goodbye
				// (its PUB dropped a subscriber that stalled, or a network
				// fault): connect again; the leader re-admits the rank on
				// its next answer.
				w.log.Warn("kvbm worker: lost the leader's side channel connection; reconnecting", "err", err)
				switch gone := w.redial(r); {
				case gone == nil:
					continue
				case errors.Is(gone, errTransportClosed):
					w.finish(ErrClosed)
				default:
					w.log.Warn("kvbm worker: the leader's side channel is gone", "err", gone)
					w.finish(fmt.Errorf("%w: %v", errLeaderGone, gone))
				}
				return
			}
			w.log.Warn("kvbm worker: lost the leader's side channel", "err", err)
			w.finish(fmt.Errorf("%w: %v", errLeaderGone, err))
			return
		}
		w.lastHeard.Store(time.Now().UnixNano())
		m, err := decodeLeader(frames)
		if err != nil {
			w.log.Warn("kvbm worker side channel: ignoring message", "err", err)
			continue
		}
		switch m.fn {
		case fnWorkerMetadata:
			w.send(m.id, fnWorkerMetadata, w.metadata())
		case fnLeaderMetadata:
			w.onLeaderMetadata(m)
		case fnPing:
			w.send(m.id, fnAck, nil)
		case fnStep:
			w.mu.Lock()
			dup := m.id <= w.lastOp
			if !dup {
				w.lastOp = m.id
			}
			w.mu.Unlock()
			if dup {
				continue
			}
			select {
			case w.exec <- m:
			case <-w.stop:
			}
		case fnShutdown:
			w.log.Info("kvbm worker: the leader closed the side channel")
			w.finish(errLeaderGone)
			return
		default:
			w.log.Debug("kvbm worker side channel: unknown function", "function", m.fn)
		}
	}
}

// watchLeader redials the subscription when the leader has been silent for
// LeaderSilence, then again every LeaderSilence while it stays silent (the
// leader may be down or restarting). It ends with the run loop.
func (w *Member) watchLeader(r subRedialer, ended <-chan struct{}) {
	defer w.wg.Done()
	silence := w.opts.LeaderSilence
	period := silence / 4
	tick := time.NewTicker(period)
	defer tick.Stop()
	last := time.Now()
	for {
		select {
		case <-w.stop:
			return
		case <-ended:
			return
		case <-tick.C:
		}
		now := time.Now()
		if now.Sub(last) > 2*period {
			// This process did not run (stopped, swapped out, starved): the
			// silence was its own, not the leader's, and what the leader sent
			// meanwhile waits in the socket. Redialing now would drop it.
			w.lastHeard.Store(now.UnixNano())
		}
		last = now
		quiet := time.Since(time.Unix(0, w.lastHeard.Load()))
		if quiet < silence {
			continue
		}
		var n uint64
		err := r.redialSub(func() { n = w.reconnects.Add(1) })
		w.lastHeard.Store(time.Now().UnixNano()) // the next attempt waits a full period
		if err != nil {
			w.log.Debug("kvbm worker side channel: redialing the leader's PUB socket", "err", err)
			continue
		}
		w.log.Info("kvbm worker: no message from the leader's side channel; reconnected its subscription to it",
			"silent", quiet.Round(time.Millisecond), "pub", w.opts.Endpoint.PubURL(), "reconnects", n)
	}
}

// redial redials the subscription every RetryInterval until it succeeds
// (nil), the worker closes (errTransportClosed) or nothing listens on the
// leader's port any more: the leader closed (its goodbye may be lost with
// the connection) or exited.
func (w *Member) redial(r subRedialer) error {
	for {
		var n uint64
		err := r.redialSub(func() {
			w.lastHeard.Store(time.Now().UnixNano())
			n = w.reconnects.Add(1)
		})
		if err == nil {
			w.log.Info("kvbm worker: reconnected its subscription to the leader's side channel",
				"pub", w.opts.Endpoint.PubURL(), "reconnects", n)
			return nil
		}
		if errors.Is(err, errTransportClosed) || errors.Is(err, syscall.ECONNREFUSED) {
			return err
		}
		select {
		case <-w.stop:
			return errTransportClosed
		case <-time.After(w.opts.RetryInterval):
		}
	}
}

// Reconnects is the number of times the subscription was redialed after the
// leader went silent.
func (w *Member) Reconnects() uint64 { return w.reconnects.Load() }

func (w *Member) onLeaderMetadata(m leaderMsg) {
	var md LeaderMetadata
	if err := unmarshal(m.payload, &md); err != nil {
		w.send(m.id, fnAck, []byte(err.Error()))
		return
	}
	w.mu.Lock()
	switch {
	case w.meta == nil:
		w.meta = &md
		w.mu.Unlock()
		w.send(m.id, fnAllocating, nil)
		w.log.Info("KVBM worker is under initialization. It could take a while if set with large CPU or DISK cache size. Please wait...",
			"host_blocks", md.NumHostBlocks, "disk_blocks", md.NumDiskBlocks)
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			err := w.opts.Allocate(md)
			if err != nil {
				err = fmt.Errorf("wire: rank %d: allocating %d host and %d disk blocks: %w", w.opts.Rank, md.NumHostBlocks, md.NumDiskBlocks, err)
				w.log.Error("kvbm worker: allocation failed", "err", err)
			}
			if err == nil {
				// Before allocDone: a repeated leader_metadata is acked as
				// soon as allocDone is set, and the leader may broadcast an
				// operation right after that ack.
				close(w.ready)
			}
			w.mu.Lock()
			w.allocDone, w.allocErr = true, err
			w.mu.Unlock()
			if err == nil {
				w.send(m.id, fnAck, nil)
			} else {
				w.send(m.id, fnAck, []byte(err.Error()))
			}
		}()
	case !w.allocDone:
		w.mu.Unlock()
		w.send(m.id, fnAllocating, nil)
	default:
		// A repeat: the leader missed our ack.
		var reply []byte
		if w.allocErr != nil {
			reply = []byte(w.allocErr.Error())
		} else if *w.meta != md {
			reply = fmt.Appendf(nil, "rank %d already allocated %+v, leader now asks %+v", w.opts.Rank, *w.meta, md)
		}
		w.mu.Unlock()
		w.send(m.id, fnAck, reply)
	}
}

// executor runs operations one at a time, in order.
func (w *Member) executor() {
	defer w.wg.Done()
	for {
		select {
		case <-w.stop:
			return
		case m := <-w.exec:
			var reply []byte
			select {
			case <-w.ready:
				if err := w.execute(m.payload); err != nil {
					reply = []byte(err.Error())
					if len(reply) == 0 {
						reply = []byte("error")
					}
				}
			default:
				reply = fmt.Appendf(nil, "rank %d has not finished its handshake", w.opts.Rank)
			}
			w.send(m.id, fnAck, reply)
		}
	}
}

// execute runs Execute, turning a panic into an error: a bug in one
// operation must not take down the engine's worker process.
func (w *Member) execute(step []byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("wire: internal error executing an operation: %v", r)
			w.log.Error("kvbm worker: recovered from a panic in Execute", "err", err)
		}
	}()
	return w.opts.Execute(w.execCtx, step)
}

// Close stops the worker's goroutines (an allocation in progress finishes
// first) and closes its connection.
func (w *Member) Close() error {
	w.once.Do(func() {
		w.send(0, fnBye, nil) // best effort: the leader logs a departure, not a failure
		close(w.stop)
		w.execCancel() // an operation still waiting gives up
		w.mu.Lock()
		t := w.t
		w.mu.Unlock()
		if t != nil {
			_ = t.close()
		}
		w.wg.Wait()
		w.finish(ErrClosed)
	})
	return nil
}

// Forged is the number of unauthenticated messages dropped.
func (w *Member) Forged() uint64 { return w.forged.count() }
