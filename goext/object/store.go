package object

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
)

// warnedKeyNotSecret: the warning about a key that is no secret is logged
// once per process.
var warnedKeyNotSecret atomic.Bool

// rateLog lets one message through per interval and counts the others.
type rateLog struct {
	mu         sync.Mutex // guards the fields below
	last       time.Time
	suppressed int
}

// allow reports whether to log now, with how many were held back since the
// last one logged.
func (r *rateLog) allow(now time.Time, every time.Duration) (suppressed int, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.last.IsZero() && now.Sub(r.last) < every {
		r.suppressed++
		return 0, false
	}
	n := r.suppressed
	r.last, r.suppressed = now, 0
	return n, true
}

// ErrUnavailable: the circuit breaker refused the request (the store failed
// repeatedly; it is tried again after the cool-down).
var ErrUnavailable = errors.New("object: store unavailable (circuit breaker open)")

// Defaults of StoreOptions.
const (
	DefaultQueueBlocks = 256
	DefaultQueueBytes  = 256 << 20 // the queue holds copies: bounded in bytes too
	DefaultUploads     = 8
	DefaultLookups     = 32
	// DownloadsInFlight bounds the downloads of one load batch a worker
	// runs at a time (the leader's cost model counts their waves).
	DownloadsInFlight       = 16
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
	// Key authenticates the objects (integrity.ObjectKey); the zero Key:
	// derived from Client's S3 secret key and bucket (Client.ObjectKey).
	// Every instance sharing the bucket must use the same key.
	Key    integrity.Key
	Logger *slog.Logger
	Now    func() time.Time // nil: time.Now
	// BucketCheck, when set, checks the bucket in the background; the
	// store is not Ready until it answers, and Unavailable while it fails
	// (bucketcheck.go).
	BucketCheck *BucketCheck
}

// Store is one rank's view of G4: uploads in the background, verified
// downloads, lookups. Safe for concurrent use.
type Store struct {
	c   *Client
	fp  fingerprint.Fingerprint
	bpb int
	reg *Registry
	br  *breaker
	key integrity.Key
	now func() time.Time
	log *slog.Logger
	// verifyLog rate-limits the warnings of objects that do not verify.
	verifyLog rateLog
	timeout   time.Duration
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
	salt, hash, parent uint64
	body               *[]byte // payload in place; the uploader seals the header
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
	if !o.Key.Valid() {
		o.Key = o.Client.ObjectKey(nil)
	}
	if !o.Key.Secret() && !warnedKeyNotSecret.Swap(true) {
		o.Logger.Warn("kvbm G4: anonymous access and no "+config.EnvStorageSecret+": G4 objects are only "+
			"checksummed, not authenticated (their MAC key derives from the bucket's name alone, which is no "+
			"secret), so whoever can write to the bucket or sits on the way to an http:// endpoint can forge "+
			"KV; set "+config.EnvStorageSecret+" (the same on every instance) to authenticate them",
			"bucket", o.Client.Bucket())
	}
	s := &Store{c: o.Client, fp: o.Fingerprint, bpb: o.BlockBytes, reg: o.Registry, key: o.Key, now: o.Now,
		br: newBreaker(o.BreakerThreshold, o.BreakerCooldown, o.Now), log: o.Logger,
		timeout: o.RequestTimeout, lookupSem: make(chan struct{}, o.Lookups), queue: make(chan upload, o.QueueBlocks)}
	// One byte of spare capacity: a download reads one byte past the
	// largest valid object to see an oversized one, into the same buffer.
	s.bufs.New = func() any { b := make([]byte, HeaderSize+s.bpb, HeaderSize+s.bpb+1); return &b }
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

// Key is the object key of seqHash for a request without cache salt or
// LoRA (hashing.DefaultSaltHash).
func (s *Store) Key(seqHash uint64) string { return Key(s.fp, seqHash) }

// KeyFor is the object key of seqHash for a request of salt hash salt: a
// salted block's key carries the salt's tag (SaltKey, salt.go).
func (s *Store) KeyFor(salt, seqHash uint64) string {
	if tag := s.SaltTag(salt); tag != "" {
		return SaltKey(tag, s.fp, seqHash)
	}
	return Key(s.fp, seqHash)
}

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
	return s.EnqueueSalted(0, seqHash, parent, payload)
}

// EnqueueSalted is Enqueue for a block of a request of salt hash salt (0:
// the default), stored under KeyFor(salt, seqHash).
func (s *Store) EnqueueSalted(salt, seqHash, parent uint64, payload []byte) bool {
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
	// Only the copy happens here, on the engine's step: checksums and MAC
	// are computed by the uploader.
	b := s.bufs.Get().(*[]byte)
	copy((*b)[HeaderSize:], payload)
	s.pending.Add(1)
	select {
	case s.queue <- upload{salt: salt, hash: seqHash, parent: parent, body: b}:
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
	seal(*u.body, s.key, s.fp, u.hash, u.parent)
	ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
	created, err := s.c.PutIfAbsent(ctx, s.KeyFor(u.salt, u.hash), *u.body)
	cancel()
	s.done(err)
	if err != nil {
		stats.errors.Add(1)
		stats.dropped.Add(1)
		s.log.Debug("kvbm G4: upload failed", "key", s.KeyFor(u.salt, u.hash), "err", err)
		return
	}
	s.reg.Add(u.hash)
	// Counted before it is acknowledged: whoever sees the ack sees the count.
	if created {
		stats.uploaded.Add(1)
	} else {
		stats.alreadyStored.Add(1)
	}
	s.ackMu.Lock()
	if len(s.acked) < maxAcked {
		s.acked = append(s.acked, u.hash)
	}
	s.ackMu.Unlock()
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
// size) and verifies it. Any failure is a miss that the registry forgets
// (the engine recomputes the block). An object that does not verify is
// counted and logged; it is deleted from the shared bucket only when this
// instance proves it damaged (confirmDamaged): a failed request, a cut
// body, or wrong bytes seen once may be the network's doing, and a MAC
// mismatch of intact bytes may be another key's valid object, so none of
// them costs the other instances their copy. dst's contents are undefined
// after an error.
func (s *Store) Download(ctx context.Context, seqHash uint64, dst []byte) error {
	return s.DownloadSalted(ctx, 0, seqHash, dst)
}

// DownloadSalted is Download of a block of a request of salt hash salt
// (0: the default), stored under KeyFor(salt, seqHash).
func (s *Store) DownloadSalted(ctx context.Context, salt, seqHash uint64, dst []byte) error {
	if len(dst) != s.bpb {
		return fmt.Errorf("object: G4 download into %d bytes, want %d", len(dst), s.bpb)
	}
	if !s.allow() {
		return ErrUnavailable
	}
	key := s.KeyFor(salt, seqHash)
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	b := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(b)
	body, err := s.fetch(ctx, key, *b)
	if err == nil {
		var payload []byte
		if _, payload, err = Verify(body, s.key, s.fp, seqHash, s.bpb); err == nil {
			copy(dst, payload)
		}
	}
	s.done(err)
	if err == nil {
		stats.downloaded.Add(1)
		return nil
	}
	s.reg.Remove(seqHash)
	switch {
	case errors.Is(err, ErrCorrupt):
		stats.verifyFailures.Add(1)
		deleted := damaged(err) && s.confirmDamaged(ctx, key, body)
		s.logVerifyFailure(key, err, deleted)
		return fmt.Errorf("%w (G4 block %s)", err, key) // errprefix: err, of this package, carries it
	case errors.Is(err, ErrNotFound):
		return fmt.Errorf("%w (G4 block %s)", err, key) // errprefix: err, of this package, carries it
	default:
		stats.errors.Add(1)
		return fmt.Errorf("object: G4 block %s: %w", key, err)
	}
}

// fetch reads the object under key into buf, at most one byte past the
// largest valid object (Verify rejects the length).
func (s *Store) fetch(ctx context.Context, key string, buf []byte) ([]byte, error) {
	return s.c.get(ctx, key, buf, HeaderSize+s.bpb)
}

// confirmDamaged reads key again and deletes the object when the second
// read, without a transport error, returns exactly the damaged bytes of the
// first: the stored object itself is wrong, for every instance, and would
// block its key (uploads are conditional). It reports whether it deleted.
func (s *Store) confirmDamaged(ctx context.Context, key string, first []byte) bool {
	b := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(b)
	second, err := s.fetch(ctx, key, *b)
	if err != nil {
		if !errors.Is(err, ErrNotFound) {
			stats.errors.Add(1)
		}
		return false
	}
	if !bytes.Equal(first, second) {
		return false
	}
	stats.corrupt.Add(1)
	dctx, dcancel := context.WithTimeout(s.ctx, s.timeout)
	defer dcancel()
	if err := s.c.Delete(dctx, key); err != nil {
		stats.errors.Add(1)
		s.log.Debug("kvbm G4: could not delete a damaged object", "key", key, "err", err)
		return false
	}
	return true
}

// verifyLogEvery spaces the warnings about objects that do not verify.
const verifyLogEvery = 10 * time.Second

// logVerifyFailure warns about an object that did not verify, at most once
// per verifyLogEvery (the counter has them all).
func (s *Store) logVerifyFailure(key string, err error, deleted bool) {
	n, ok := s.verifyLog.allow(s.now(), verifyLogEvery)
	if !ok {
		return
	}
	msg := "kvbm G4: object does not verify; served as a miss (the engine recomputes the block)"
	switch {
	case deleted:
		msg = "kvbm G4: object damaged (the same wrong bytes read twice); deleted, served as a miss"
	case errors.Is(err, ErrUnauthenticated):
		msg += "; every instance sharing the bucket must use the same key (" + config.EnvStorageSecret +
			", or the same S3 secret key)"
	}
	s.log.Warn(msg, "key", key, "err", err, "not_logged_since_last", n)
}

// Lookup returns how many leading hashes are stored: hashes the registry
// knows count at once. The first unknown one is asked alone (a prefix nobody
// stored costs one request); if it is stored, the rest are asked with
// parallel HEAD requests (at most StoreOptions.Lookups in flight for the
// whole store) until ctx ends. Found hashes join the registry. With the
// breaker open only the registry answers.
func (s *Store) Lookup(ctx context.Context, hashes []uint64) int {
	return s.LookupSalted(ctx, 0, hashes)
}

// LookupSalted is Lookup of the blocks of a request of salt hash salt (0:
// the default), stored under KeyFor(salt, hash).
func (s *Store) LookupSalted(ctx context.Context, salt uint64, hashes []uint64) int {
	known := s.reg.PrefixLen(hashes)
	rest := hashes[known:]
	if len(rest) == 0 || s.br.refusing() {
		return known
	}
	// The first unknown block decides most lookups: a prefix nobody stored
	// costs one request, not one per block.
	if !s.head(ctx, salt, rest[0]) {
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
			found[i] = s.head(ctx, salt, h)
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
func (s *Store) head(ctx context.Context, salt, h uint64) bool {
	if s.reg.Contains(h) {
		return true
	}
	if !s.allow() {
		return false
	}
	stats.heads.Add(1)
	ok, err := s.c.Head(ctx, s.KeyFor(salt, h))
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
