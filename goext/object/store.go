package object

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/fingerprint"
)

// ErrUnavailable: the circuit breaker refused the request (the store failed
// repeatedly; it is tried again after the cool-down).
var ErrUnavailable = errors.New("object: store unavailable (circuit breaker open)")

// Defaults of StoreOptions.
const (
	DefaultQueueBlocks      = 256
	DefaultQueueBytes       = 256 << 20 // the queue holds copies: bounded in bytes too
	DefaultUploads          = 8
	DefaultLookups          = 32
	DefaultBreakerThreshold = 3
	DefaultBreakerCooldown  = 2 * time.Second
	DefaultRequestTimeout   = 10 * time.Second
)

// StoreOptions configure a Store.
type StoreOptions struct {
	Client      *Client
	Fingerprint fingerprint.Fingerprint // this rank's
	// BlockBytes is the payload of one object (this rank's bytes per block).
	BlockBytes int
	// Registry of hashes known to be stored; nil: a private one of 100,000.
	Registry *Registry
	// QueueBlocks bounds the uploads waiting (each holds a copy of its
	// block; 0: DefaultQueueBlocks, at most DefaultQueueBytes, at least 8);
	// Uploads bounds those in flight; Lookups bounds the HEAD requests of
	// all lookups in flight together.
	QueueBlocks, Uploads, Lookups int
	// Breaker: consecutive failures that open it, and how long it stays
	// open before one request tests the store again.
	BreakerThreshold int
	BreakerCooldown  time.Duration
	// RequestTimeout bounds one PUT or GET.
	RequestTimeout time.Duration
	Logger         *slog.Logger
	Now            func() time.Time // nil: time.Now
	// BucketCheck, when set, checks the bucket in the background; the
	// store is not Ready until it answers, and Unavailable while it fails
	// (bucketcheck.go).
	BucketCheck *BucketCheck
}

// Store is one rank's view of G4: uploads in the background, verified
// downloads, lookups. Safe for concurrent use.
type Store struct {
	c       *Client
	fp      fingerprint.Fingerprint
	bpb     int
	reg     *Registry
	br      *breaker
	log     *slog.Logger
	timeout time.Duration
	// lookupSem bounds the HEAD requests of all lookups together.
	lookupSem chan struct{}

	queue   chan upload
	bufs    sync.Pool
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	pending sync.WaitGroup // queued or running uploads (Flush)

	ackMu sync.Mutex // guards acked
	acked []uint64   // hashes stored since the last TakeAcked (bounded)

	closeMu sync.RWMutex // guards closed: enqueuers (read) against Close (write)
	closed  bool

	bucket  atomic.Int32  // state of the bucket check (bucketcheck.go)
	checked chan struct{} // closed once the check's first attempt answered
}

type upload struct {
	hash uint64
	body *[]byte
}

// NewStore starts the upload goroutines.
func NewStore(o StoreOptions) (*Store, error) {
	if o.Client == nil {
		return nil, errors.New("object: store: no client")
	}
	if o.BlockBytes <= 0 {
		return nil, fmt.Errorf("object: store: block bytes %d: must be positive", o.BlockBytes)
	}
	if o.Registry == nil {
		o.Registry = NewRegistry(100000)
	}
	if o.QueueBlocks <= 0 {
		o.QueueBlocks = max(8, min(DefaultQueueBlocks, DefaultQueueBytes/(HeaderSize+o.BlockBytes)))
	}
	if o.Uploads <= 0 {
		o.Uploads = DefaultUploads
	}
	if o.Lookups <= 0 {
		o.Lookups = DefaultLookups
	}
	if o.BreakerThreshold <= 0 {
		o.BreakerThreshold = DefaultBreakerThreshold
	}
	if o.BreakerCooldown <= 0 {
		o.BreakerCooldown = DefaultBreakerCooldown
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = DefaultRequestTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	s := &Store{c: o.Client, fp: o.Fingerprint, bpb: o.BlockBytes, reg: o.Registry,
		br: newBreaker(o.BreakerThreshold, o.BreakerCooldown, o.Now), log: o.Logger,
		timeout: o.RequestTimeout, lookupSem: make(chan struct{}, o.Lookups), queue: make(chan upload, o.QueueBlocks)}
	s.bufs.New = func() any { b := make([]byte, HeaderSize+s.bpb); return &b }
	s.ctx, s.cancel = context.WithCancel(context.Background())
	for range o.Uploads {
		s.wg.Add(1)
		go s.uploader()
	}
	s.wg.Add(1)
	go s.healer(o.BreakerCooldown)
	s.startBucketCheck(o.BucketCheck)
	return s, nil
}

// healer tests an unavailable store once per cool-down (is the bucket
// there?), so the tier comes back by itself even when no upload, download
// or lookup happens to test it.
func (s *Store) healer(every time.Duration) {
	defer s.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		if !s.br.isOpen() || !s.br.allow() {
			continue
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
		_, err := s.c.mc.BucketExists(ctx, s.c.bucket)
		cancel()
		if s.ctx.Err() != nil {
			s.br.abandon()
			return
		}
		s.done(err)
	}
}

// Fingerprint is the fingerprint the store's keys and headers carry.
func (s *Store) Fingerprint() fingerprint.Fingerprint { return s.fp }

// Registry is the store's registry of known stored hashes.
func (s *Store) Registry() *Registry { return s.reg }

// Key is the object key of seqHash.
func (s *Store) Key(seqHash uint64) string { return Key(s.fp, seqHash) }

// QueueLen and QueueCap are the uploads waiting and the most that may wait.
func (s *Store) QueueLen() int { return len(s.queue) }
func (s *Store) QueueCap() int { return cap(s.queue) }

// Available reports whether the breaker lets requests through.
func (s *Store) Available() bool { return !s.br.isOpen() }

// Enqueue queues payload (one block, copied now: the caller may reuse it at
// once) for upload under seqHash. It never blocks: a full queue, an open
// breaker or a closed store drops the upload and returns false (counted).
// A hash the registry already holds is not uploaded again (true).
func (s *Store) Enqueue(seqHash, parent uint64, payload []byte) bool {
	if len(payload) != s.bpb {
		s.log.Warn("kvbm G4: upload of a block of the wrong size ignored", "bytes", len(payload), "want", s.bpb)
		stats.dropped.Add(1)
		return false
	}
	if s.reg.Contains(seqHash) {
		return true
	}
	if s.br.refusing() {
		stats.dropped.Add(1)
		return false
	}
	s.closeMu.RLock()
	defer s.closeMu.RUnlock()
	if s.closed {
		stats.dropped.Add(1)
		return false
	}
	b := s.bufs.Get().(*[]byte)
	encodeInto(*b, s.fp, seqHash, parent, payload)
	s.pending.Add(1)
	select {
	case s.queue <- upload{hash: seqHash, body: b}:
		stats.queued.Add(1)
		return true
	default:
		s.pending.Done()
		s.bufs.Put(b)
		stats.dropped.Add(1)
		return false
	}
}

func (s *Store) uploader() {
	defer s.wg.Done()
	for u := range s.queue {
		s.put(u)
		s.bufs.Put(u.body)
		stats.queued.Add(-1)
		s.pending.Done()
	}
}

func (s *Store) put(u upload) {
	if !s.awaitFirstCheck() || s.reg.Contains(u.hash) {
		return
	}
	if !s.allow() {
		stats.dropped.Add(1)
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
	created, err := s.c.PutIfAbsent(ctx, s.Key(u.hash), *u.body)
	cancel()
	s.done(err)
	if err != nil {
		stats.errors.Add(1)
		stats.dropped.Add(1)
		s.log.Debug("kvbm G4: upload failed", "key", s.Key(u.hash), "err", err)
		return
	}
	s.reg.Add(u.hash)
	s.ackMu.Lock()
	if len(s.acked) < maxAcked {
		s.acked = append(s.acked, u.hash)
	}
	s.ackMu.Unlock()
	if created {
		stats.uploaded.Add(1)
	} else {
		stats.alreadyStored.Add(1)
	}
}

func (s *Store) allow() bool { return s.br.allow() }

// done feeds a request's outcome to the breaker. Not-found answers are
// successes: the store is up.
func (s *Store) done(err error) {
	ok := err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrCorrupt)
	opened, closed := s.br.done(ok)
	switch {
	case opened:
		stats.breakerOpen.Add(1)
		s.log.Warn("kvbm G4: object store failing; uploads, downloads and lookups paused (retried every cool-down)",
			"bucket", s.c.Bucket(), "err", err)
	case closed:
		stats.breakerOpen.Add(-1)
		s.log.Info("kvbm G4: object store reachable again", "bucket", s.c.Bucket())
	}
}

// maxAcked bounds the hashes kept for TakeAcked between two calls.
const maxAcked = 1 << 16

// TakeAcked returns the hashes stored (uploaded, or found already stored)
// since the last call: a leader in another process adds them to its
// registry.
func (s *Store) TakeAcked() []uint64 {
	s.ackMu.Lock()
	defer s.ackMu.Unlock()
	a := s.acked
	s.acked = nil
	return a
}

// Flush waits until every upload queued so far finished, or ctx ends.
func (s *Store) Flush(ctx context.Context) error {
	ch := make(chan struct{})
	go func() { s.pending.Wait(); close(ch) }()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Download fetches seqHash's object into dst (len(dst) must be the block
// size) and verifies it. A missing object or one that does not verify is
// forgotten by the registry; a corrupt one is also deleted (it would fail
// every instance). dst's contents are undefined after an error.
func (s *Store) Download(ctx context.Context, seqHash uint64, dst []byte) error {
	if len(dst) != s.bpb {
		return fmt.Errorf("object: G4 download into %d bytes, want %d", len(dst), s.bpb)
	}
	if !s.allow() {
		return ErrUnavailable
	}
	key := s.Key(seqHash)
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	b := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(b)
	body, err := s.c.Get(ctx, key, *b, HeaderSize+s.bpb)
	if err == nil {
		_, payload, verr := Verify(body, s.fp, seqHash, s.bpb)
		if verr == nil {
			copy(dst, payload)
		}
		err = verr
	}
	s.done(err)
	switch {
	case err == nil:
		stats.downloaded.Add(1)
		return nil
	case errors.Is(err, ErrCorrupt):
		stats.corrupt.Add(1)
		s.reg.Remove(seqHash)
		s.log.Warn("kvbm G4: object does not verify; deleting it (the engine recomputes the block)", "key", key, "err", err)
		dctx, dcancel := context.WithTimeout(s.ctx, s.timeout)
		if derr := s.c.Delete(dctx, key); derr != nil {
			s.log.Debug("kvbm G4: could not delete a corrupt object", "key", key, "err", derr)
		}
		dcancel()
	case errors.Is(err, ErrNotFound):
		s.reg.Remove(seqHash)
	default:
		stats.errors.Add(1)
	}
	if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrNotFound) {
		return fmt.Errorf("%w (G4 block %s)", err, key) // errprefix: err, of this package, carries it
	}
	return fmt.Errorf("object: G4 block %s: %w", key, err)
}

// Lookup returns how many leading hashes are stored: hashes the registry
// knows count at once. The first unknown one is asked alone (a prefix nobody
// stored costs one request); if it is stored, the rest are asked with
// parallel HEAD requests (at most StoreOptions.Lookups in flight for the
// whole store) until ctx ends. Found hashes join the registry. With the
// breaker open only the registry answers.
func (s *Store) Lookup(ctx context.Context, hashes []uint64) int {
	known := s.reg.PrefixLen(hashes)
	rest := hashes[known:]
	if len(rest) == 0 || s.br.refusing() {
		return known
	}
	// The first unknown block decides most lookups: a prefix nobody stored
	// costs one request, not one per block.
	if !s.head(ctx, rest[0]) {
		return known
	}
	found := make([]bool, len(rest))
	found[0] = true
	var wg sync.WaitGroup
	for i := 1; i < len(rest); i++ {
		h := rest[i]
		if s.reg.Contains(h) {
			found[i] = true
			continue
		}
		select {
		case s.lookupSem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func() {
			defer func() { <-s.lookupSem; wg.Done() }()
			found[i] = s.head(ctx, h)
		}()
	}
	wg.Wait()
	n := known
	for _, f := range found {
		if !f {
			break
		}
		n++
	}
	return n
}

// head asks the store whether h is stored; a found hash joins the registry.
func (s *Store) head(ctx context.Context, h uint64) bool {
	if s.reg.Contains(h) {
		return true
	}
	if !s.allow() {
		return false
	}
	stats.heads.Add(1)
	ok, err := s.c.Head(ctx, s.Key(h))
	if ctx.Err() != nil {
		s.br.abandon() // our deadline, not the store's failure
		return false
	}
	if err != nil {
		stats.errors.Add(1)
	}
	s.done(err)
	if ok {
		s.reg.Add(h)
	}
	return ok
}

// Close stops the uploaders; queued uploads are abandoned.
func (s *Store) Close() {
	s.closeMu.Lock()
	if s.closed {
		s.closeMu.Unlock()
		return
	}
	s.closed = true
	s.cancel()
	close(s.queue)
	s.closeMu.Unlock()
	s.wg.Wait()
}
