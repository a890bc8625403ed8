// Package pagestore is a keyed page store over the disk tier
// (storage.DiskRegion): the storage behind kvbm's SGLang HiCache backend
// (python/kvbm/sglang_integration). SGLang names each host page by its own
// hash string; the store maps that string, salted by a fingerprint of the
// engine's setup, to a 128-bit key and the key to one slot of the tier file.
//
// Persistence reuses the disk tier's block headers: a slot's header records
// the key (SeqHash = low half, Parent = high half), the payload's XXH3 and
// MAC and the write time, so a store reopened on the same file (same
// fingerprint and rank) finds every page whose header verifies. A page whose
// bytes do not match its checksum or MAC is dropped and reported missing,
// never returned.
//
// Capacity is fixed (the file's slots); a full store evicts its least
// recently used page that no read is using.
package pagestore

import (
	"cmp"
	"container/list"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/storage"
)

// Options configures a Store.
type Options struct {
	Dir       string // DYN_KVBM_DISK_CACHE_DIR
	NumPages  int
	PageBytes int64
	// Identity describes everything that makes two pages with one SGLang
	// key interchangeable (model, parallel layout, page layout, dtype):
	// it is hashed into the fingerprint that names the file and salts keys.
	Identity       string
	Rank           int
	Persist        bool // DYN_KVBM_DISK_PERSIST
	DisableODirect bool
	OpenDirect     bool
	Key            integrity.Key // authenticates a persistent file's pages
	Logger         *slog.Logger
	// Object, when set, is the shared object tier (G4, *object.Store):
	// every page stored is also uploaded in the background, and a page the
	// disk tier lacks is looked up and downloaded (verified) there, then
	// kept on disk. Its objects are keyed by the fingerprint and the low
	// half of the page key.
	Object ObjectTier
	// LookupTimeout bounds one Exists' requests to Object (0:
	// config.DefaultObjectLookupTimeout).
	LookupTimeout time.Duration
	// Events, when set, receives the disk tier's changes as kvbm tier
	// events (holder HolderKvbmDisk) named by the engine's own event hash
	// of each page (Ext, passed with the key to PutExt / GetExt), without
	// tokens (BlockEvent.ByHash): a page stored, first read, or learnt
	// after a restart is a store; an evicted, dropped or cleared page a
	// removal. Pages without an event hash are not announced. Called with
	// the store's lock held: it must not call back into the store.
	Events events.Sink
}

// Ext is the engine's event hash of a page (what its KV events name the
// page by); OK is false when the page has none.
type Ext struct {
	Hash uint64
	OK   bool
}

// ObjectTier is what the store uses of goext/object.Store.
type ObjectTier interface {
	Enqueue(seqHash, parent uint64, payload []byte) bool
	Download(ctx context.Context, seqHash uint64, dst []byte) error
	Lookup(ctx context.Context, hashes []uint64) int
}

// Key is a page's key in the store: a 128-bit hash of the fingerprint and
// the engine's key string.
type Key struct{ Lo, Hi uint64 }

// Fingerprint is the fingerprint of a store identity.
func Fingerprint(identity string) fingerprint.Fingerprint {
	sum := sha256.Sum256([]byte("kvbm-pagestore/1\x00" + identity))
	var fp fingerprint.Fingerprint
	copy(fp[:], sum[:])
	return fp
}

// KeyOf maps an engine key string to a store key under fp.
func KeyOf(fp fingerprint.Fingerprint, s []byte) Key {
	buf := make([]byte, 0, len(fp)+len(s))
	buf = append(append(buf, fp[:]...), s...)
	h := xxh3.Hash128(buf)
	return Key{Lo: h.Lo, Hi: h.Hi}
}

type slot struct {
	key  Key
	ext  Ext    // the engine's event hash, once known (not persisted)
	sum  uint64 // XXH3 of the payload
	used bool   // holds a page that is in the index
	pins int    // reads or a write in progress: not evicted
	elem *list.Element
}

// Stats are the store's counters since it opened.
type Stats struct {
	Path            string         `json:"path"`
	Persistent      bool           `json:"persistent"`
	Fingerprint     string         `json:"fingerprint"`
	NumPages        int            `json:"num_pages"`
	PageBytes       int64          `json:"page_bytes"`
	Used            int            `json:"used"`
	Recovered       int            `json:"recovered"`
	Discarded       map[string]int `json:"discarded"`
	Puts            int64          `json:"puts"`
	PutDuplicates   int64          `json:"put_duplicates"`
	PutFailures     int64          `json:"put_failures"`
	Hits            int64          `json:"hits"`
	Misses          int64          `json:"misses"`
	Corrupt         int64          `json:"corrupt"`
	ObjectHits      int64          `json:"object_hits"`
	ObjectUploads   int64          `json:"object_uploads"`
	Evictions       int64          `json:"evictions"`
	BytesWritten    int64          `json:"bytes_written"`
	BytesRead       int64          `json:"bytes_read"`
	RecoverySeconds float64        `json:"recovery_seconds"`
}

// Store is a keyed page store; safe for concurrent use.
type Store struct {
	d         *storage.DiskRegion
	fp        fingerprint.Fingerprint
	pageBytes int64
	log       *slog.Logger

	mu    sync.Mutex
	index map[Key]int
	slots []slot
	free  []int
	lru   *list.List // of slot indices, most recent first

	bufs sync.Pool

	recovered int
	discarded map[string]int
	recSecs   float64

	obj           ObjectTier
	lookupTimeout time.Duration
	sink          events.Sink // nil: no events

	puts, dups, putFail, hits, misses, corrupt, evictions, bytesW, bytesR, objHits, objUploads atomic.Int64
}

// Open creates or reopens the store's tier file.
func Open(o Options) (*Store, error) {
	if o.PageBytes <= 0 || o.NumPages <= 0 {
		return nil, fmt.Errorf("pagestore: %d pages of %d bytes: both must be > 0", o.NumPages, o.PageBytes)
	}
	if o.Identity == "" {
		return nil, errors.New("pagestore: empty identity")
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	fp := Fingerprint(o.Identity)
	d, err := storage.NewDiskRegion(storage.DiskOptions{
		Dir: o.Dir, Rank: o.Rank, NumBlocks: o.NumPages, BlockBytes: o.PageBytes,
		DisableODirect: o.DisableODirect, OpenDirect: o.OpenDirect,
		Persist: o.Persist, Fingerprint: fp, Key: o.Key, Logger: log,
	})
	if err != nil {
		return nil, fmt.Errorf("pagestore: %w", err)
	}
	s := &Store{d: d, fp: fp, pageBytes: o.PageBytes, log: log, index: map[Key]int{},
		slots: make([]slot, o.NumPages), lru: list.New(), discarded: map[string]int{},
		obj: o.Object, lookupTimeout: o.LookupTimeout, sink: o.Events}
	if s.lookupTimeout <= 0 {
		s.lookupTimeout = config.DefaultObjectLookupTimeout
	}
	stride := int(d.Stride())
	s.bufs.New = func() any { b := alignedBuf(stride); return &b }
	s.recover()
	return s, nil
}

// alignedBuf returns n bytes at a storage.Alignment boundary (O_DIRECT);
// Go's collector does not move heap objects.
func alignedBuf(n int) []byte {
	b := make([]byte, n+storage.Alignment)
	off := 0
	if r := int(uintptr(unsafe.Pointer(unsafe.SliceData(b))) % storage.Alignment); r != 0 {
		off = storage.Alignment - r
	}
	return b[off : off+n : off+n]
}

// recover indexes the pages the file's headers describe, oldest last in
// the LRU; the rest of the slots are free.
func (s *Store) recover() {
	rec := s.d.Recovery()
	for k, v := range rec.Discarded {
		s.discarded[k] += v
	}
	s.recSecs = rec.Duration.Seconds()
	blocks := rec.Blocks
	// Most recent first, so that PushBack builds the LRU in order.
	order := make([]int, len(blocks))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(blocks[b].WrittenAt, blocks[a].WrittenAt) })
	for _, bi := range order {
		b := blocks[bi]
		k := Key{Lo: b.SeqHash, Hi: b.Parent}
		if !b.HasParent {
			s.discarded["not_a_page"]++
			continue
		}
		if _, dup := s.index[k]; dup { // an older copy of a page rewritten elsewhere
			_ = s.d.InvalidateHeader(b.Index)
			s.discarded["duplicate"]++
			continue
		}
		sl := &s.slots[b.Index]
		sl.key, sl.sum, sl.used = k, b.PayloadSum, true
		sl.elem = s.lru.PushBack(b.Index)
		s.index[k] = b.Index
		s.recovered++
	}
	for i := len(s.slots) - 1; i >= 0; i-- {
		if !s.slots[i].used {
			s.free = append(s.free, i)
		}
	}
}

// Fingerprint is the store's fingerprint (names its file, salts its keys).
func (s *Store) Fingerprint() fingerprint.Fingerprint { return s.fp }

// PageBytes is the size of one page.
func (s *Store) PageBytes() int64 { return s.pageBytes }

// Key maps an engine key string to this store's key.
func (s *Store) Key(str []byte) Key { return KeyOf(s.fp, str) }

// Exists returns how many of keys, from the first, the store holds.
func (s *Store) Exists(keys []Key) int {
	n := s.localPrefix(keys)
	if n == len(keys) || s.obj == nil {
		return n
	}
	hashes := make([]uint64, len(keys)-n)
	for i, k := range keys[n:] {
		hashes[i] = k.Lo
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.lookupTimeout)
	defer cancel()
	return n + s.obj.Lookup(ctx, hashes)
}

// Has reports, key by key, whether the store holds it: the disk tier, then
// the object tier for the keys the disk lacks (one lookup each, all
// bounded by LookupTimeout).
func (s *Store) Has(keys []Key) []bool {
	out := make([]bool, len(keys))
	var missing []int
	s.mu.Lock()
	for i, k := range keys {
		_, out[i] = s.index[k]
		if !out[i] {
			missing = append(missing, i)
		}
	}
	s.mu.Unlock()
	if len(missing) == 0 || s.obj == nil {
		return out
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.lookupTimeout)
	defer cancel()
	for _, i := range missing {
		if ctx.Err() != nil {
			break
		}
		out[i] = s.obj.Lookup(ctx, []uint64{keys[i].Lo}) == 1
	}
	return out
}

func (s *Store) localPrefix(keys []Key) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if _, ok := s.index[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// take reserves a slot for a new page: a free one, else the least recently
// used page no read is using (evicted). -1 when every slot is in use.
func (s *Store) take() int {
	if n := len(s.free); n > 0 {
		i := s.free[n-1]
		s.free = s.free[:n-1]
		return i
	}
	for e := s.lru.Back(); e != nil; e = e.Prev() {
		i := e.Value.(int)
		if s.slots[i].pins > 0 {
			continue
		}
		s.unindex(i)
		s.evictions.Add(1)
		return i
	}
	return -1
}

// unindex removes slot i's page from the index and the LRU, announcing
// its removal (mu held).
func (s *Store) unindex(i int) {
	sl := &s.slots[i]
	if !sl.used {
		return
	}
	delete(s.index, sl.key)
	s.lru.Remove(sl.elem)
	s.announce(sl.ext, true)
	*sl = slot{pins: sl.pins}
}

// announce publishes a store or removal of the page with event hash ext
// (mu held).
func (s *Store) announce(ext Ext, removed bool) {
	if s.sink == nil || !ext.OK {
		return
	}
	s.sink.Publish(events.BlockEvent{Removed: removed, Holder: events.HolderKvbmDisk, SeqHash: ext.Hash, ByHash: true})
}

// learn records slot i's event hash when it has none yet (a page
// recovered at start, or stored without one) and announces the page
// (mu held).
func (s *Store) learn(i int, ext Ext) {
	sl := &s.slots[i]
	if !ext.OK || sl.ext.OK || !sl.used {
		return
	}
	sl.ext = ext
	s.announce(ext, false)
}

func extAt(exts []Ext, k int) Ext {
	if k < len(exts) {
		return exts[k]
	}
	return Ext{}
}

// Page is one page's bytes as segments, in order (a strided host page, e.g.
// SGLang's page-first layout, is one segment per K/V half): their lengths add
// up to PageBytes.
type Page [][]byte

func (p Page) len() int64 {
	n := int64(0)
	for _, s := range p {
		n += int64(len(s))
	}
	return n
}

// gather copies p into buf.
func (p Page) gather(buf []byte) {
	off := 0
	for _, s := range p {
		off += copy(buf[off:], s)
	}
}

// scatter copies buf into p.
func (p Page) scatter(buf []byte) {
	off := 0
	for _, s := range p {
		off += copy(s, buf[off:])
	}
}

// Put stores page k from pages[k] (PageBytes each) under keys[k]. A key the
// store holds already is kept as it is (SGLang's keys name their content).
// ok[k] reports whether the store holds keys[k] afterwards.
func (s *Store) Put(keys []Key, pages []Page) (ok []bool, err error) {
	return s.PutExt(keys, nil, pages)
}

// PutExt is Put with the pages' event hashes (exts[k] for keys[k]; nil or
// short: none), announced to Options.Events.
func (s *Store) PutExt(keys []Key, exts []Ext, pages []Page) (ok []bool, err error) {
	if len(keys) != len(pages) {
		return nil, fmt.Errorf("pagestore: put: %d keys, %d pages", len(keys), len(pages))
	}
	ok = make([]bool, len(keys))
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	buf := *bp
	var firstErr error
	for k, key := range keys {
		if n := pages[k].len(); n != s.pageBytes {
			return ok, fmt.Errorf("pagestore: put: page %d has %d bytes, want %d", k, n, s.pageBytes)
		}
		pages[k].gather(buf)
		stored, dup, werr := s.putLocal(key, extAt(exts, k), buf)
		if dup {
			ok[k] = true
			continue
		}
		if werr != nil && firstErr == nil {
			firstErr = werr
		}
		// Uploaded whatever the disk did: the object tier is shared.
		if s.obj != nil && s.obj.Enqueue(key.Lo, key.Hi, buf[:s.pageBytes]) {
			s.objUploads.Add(1)
			stored = true
		}
		ok[k] = stored
	}
	if firstErr != nil && !anyTrue(ok) {
		return ok, firstErr
	}
	return ok, nil
}

// putLocal writes the page in buf (a full aligned I/O buffer) to a slot
// under key: stored; dup when the key was held already (kept as it is).
func (s *Store) putLocal(key Key, ext Ext, buf []byte) (stored, dup bool, err error) {
	s.mu.Lock()
	if i, have := s.index[key]; have {
		s.lru.MoveToFront(s.slots[i].elem)
		s.learn(i, ext)
		s.mu.Unlock()
		s.dups.Add(1)
		return true, true, nil
	}
	i := s.take()
	if i < 0 {
		s.mu.Unlock()
		s.putFail.Add(1)
		return false, false, nil
	}
	s.slots[i].pins++
	s.mu.Unlock()

	clear(buf[s.pageBytes:])
	sum := xxh3.Hash(buf[:s.pageBytes])
	werr := s.d.WriteBlockHeader(i, buf, &storage.BlockHeader{
		SeqHash: key.Lo, Parent: key.Hi, HasParent: true, PayloadSum: sum, WrittenAt: time.Now().UnixNano()})

	s.mu.Lock()
	sl := &s.slots[i]
	sl.pins--
	_, raced := s.index[key] // another writer stored it meanwhile
	if werr != nil || raced {
		s.free = append(s.free, i)
	} else {
		sl.key, sl.sum, sl.used = key, sum, true
		sl.elem = s.lru.PushFront(i)
		s.index[key] = i
		s.learn(i, ext)
	}
	s.mu.Unlock()
	if werr != nil {
		s.putFail.Add(1)
		s.log.Warn("kvbm: pagestore: write failed", "slot", i, "err", werr)
		return false, false, werr
	}
	s.puts.Add(1)
	s.bytesW.Add(s.pageBytes)
	return true, false, nil
}

func anyTrue(b []bool) bool {
	for _, v := range b {
		if v {
			return true
		}
	}
	return false
}

// Get reads keys[k] into dsts[k] (PageBytes each). ok[k] is false for a key
// the store does not hold, or whose page fails its checksum or MAC (the
// page is then dropped): dsts[k] is then left as it was.
func (s *Store) Get(keys []Key, dsts []Page) (ok []bool, err error) { return s.GetExt(keys, nil, dsts) }

// GetExt is Get with the pages' event hashes (see PutExt): a page read
// whose event hash was not known yet (recovered at start) is announced.
func (s *Store) GetExt(keys []Key, exts []Ext, dsts []Page) (ok []bool, err error) {
	if len(keys) != len(dsts) {
		return nil, fmt.Errorf("pagestore: get: %d keys, %d pages", len(keys), len(dsts))
	}
	ok = make([]bool, len(keys))
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	buf := *bp
	for k, key := range keys {
		if n := dsts[k].len(); n != s.pageBytes {
			return ok, fmt.Errorf("pagestore: get: page %d has %d bytes, want %d", k, n, s.pageBytes)
		}
		s.mu.Lock()
		i, have := s.index[key]
		if !have {
			s.mu.Unlock()
			ok[k] = s.getObject(key, extAt(exts, k), dsts[k], buf)
			continue
		}
		sl := &s.slots[i]
		sl.pins++
		sum := sl.sum
		s.lru.MoveToFront(sl.elem)
		s.mu.Unlock()

		rerr := s.d.ReadBlock(i, buf)
		if rerr == nil {
			rerr = s.d.VerifyRecovered(i, buf)
		}
		if rerr == nil && xxh3.Hash(buf[:s.pageBytes]) != sum {
			rerr = fmt.Errorf("pagestore: slot %d: payload checksum mismatch", i)
		}
		bad := rerr != nil
		if bad {
			// Never served, and not recovered by the next process.
			s.corrupt.Add(1)
			s.log.Warn("kvbm: pagestore: dropping a page that does not verify", "slot", i, "err", rerr)
			_ = s.d.InvalidateHeader(i)
		} else {
			dsts[k].scatter(buf[:s.pageBytes])
		}
		s.mu.Lock()
		sl.pins--
		if bad && sl.used && sl.key == key {
			s.unindex(i)
			s.free = append(s.free, i)
		} else if !bad && sl.used && sl.key == key {
			s.learn(i, extAt(exts, k))
		}
		s.mu.Unlock()
		if !bad {
			s.hits.Add(1)
			s.bytesR.Add(s.pageBytes)
			ok[k] = true
		} else {
			ok[k] = s.getObject(key, extAt(exts, k), dsts[k], buf)
		}
	}
	return ok, nil
}

// getObject reads a page the disk tier lacks from the object tier
// (verified there) into dst, and keeps it on disk.
func (s *Store) getObject(key Key, ext Ext, dst Page, buf []byte) bool {
	if s.obj == nil {
		s.misses.Add(1)
		return false
	}
	if err := s.obj.Download(context.Background(), key.Lo, buf[:s.pageBytes]); err != nil {
		s.misses.Add(1)
		return false
	}
	dst.scatter(buf[:s.pageBytes])
	s.objHits.Add(1)
	s.bytesR.Add(s.pageBytes)
	_, _, _ = s.putLocal(key, ext, buf)
	return true
}

// Clear drops every page (their headers are invalidated on disk).
func (s *Store) Clear() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var firstErr error
	for i := range s.slots {
		if !s.slots[i].used || s.slots[i].pins > 0 {
			continue
		}
		if err := s.d.InvalidateHeader(i); err != nil && firstErr == nil {
			firstErr = err
		}
		s.unindex(i)
		s.free = append(s.free, i)
	}
	return firstErr
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	used := len(s.index)
	disc := make(map[string]int, len(s.discarded))
	for k, v := range s.discarded {
		disc[k] = v
	}
	s.mu.Unlock()
	return Stats{
		Path: s.d.Path(), Persistent: s.d.Persistent(), Fingerprint: s.fp.String(),
		NumPages: s.d.NumBlocks(), PageBytes: s.pageBytes, Used: used,
		Recovered: s.recovered, Discarded: disc,
		Puts: s.puts.Load(), PutDuplicates: s.dups.Load(), PutFailures: s.putFail.Load(),
		Hits: s.hits.Load(), Misses: s.misses.Load(), Corrupt: s.corrupt.Load(), Evictions: s.evictions.Load(),
		ObjectHits: s.objHits.Load(), ObjectUploads: s.objUploads.Load(),
		BytesWritten: s.bytesW.Load(), BytesRead: s.bytesR.Load(), RecoverySeconds: s.recSecs,
	}
}

// Path is the tier file.
func (s *Store) Path() string { return s.d.Path() }

// Close closes the tier file (a persistent one is kept, its headers
// written and synced).
func (s *Store) Close() error { return s.d.Close() }
