package pagestore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/storage"
)

const pageBytes = 5000 // not a multiple of the alignment: the slot pads it

func testKey(t *testing.T, secret string) integrity.Key {
	t.Helper()
	k, err := integrity.LocalKey([]byte(secret), "")
	require.NoError(t, err)
	return k
}

func open(t *testing.T, dir string, pages int, identity string) *Store {
	t.Helper()
	s, err := Open(Options{Dir: dir, NumPages: pages, PageBytes: pageBytes, Identity: identity, Persist: true,
		DisableODirect: true, Key: testKey(t, "pagestore test secret"),
		Logger: slog.New(slog.NewTextHandler(t.Output(), nil))})
	require.NoError(t, err)
	return s
}

func page(seed int) []byte {
	b := make([]byte, pageBytes)
	for i := range b {
		b[i] = byte(seed*31 + i*7)
	}
	return b
}

// pg makes pages of whole buffers; split cuts each in two segments.
func pg(bufs ...[]byte) []Page {
	out := make([]Page, len(bufs))
	for i, b := range bufs {
		out[i] = Page{b}
	}
	return out
}

func keys(s *Store, names ...string) []Key {
	out := make([]Key, len(names))
	for i, n := range names {
		out[i] = s.Key([]byte(n))
	}
	return out
}

func privateDir(t *testing.T) string {
	d := t.TempDir()
	require.NoError(t, os.Chmod(d, 0o700))
	return d
}

func TestPutGetExistsAndRestart(t *testing.T) {
	dir := privateDir(t)
	s := open(t, dir, 8, "model=a")
	ok, err := s.Put(keys(s, "p0", "p1", "p2"), []Page{{page(0)}, {page(1)[:7], page(1)[7:4096], page(1)[4096:]}, {page(2)}})
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, true}, ok)
	require.Equal(t, 3, s.Exists(keys(s, "p0", "p1", "p2", "p3")))
	require.Equal(t, 0, s.Exists(keys(s, "p3", "p0")), "a prefix count, not a count of hits")
	require.Equal(t, 1, s.Exists(keys(s, "p0", "p3", "p1")))

	dst := [][]byte{make([]byte, pageBytes), make([]byte, pageBytes), make([]byte, pageBytes)}
	// Segmented pages: the bytes of one page in pieces, as a strided host page gives them.
	seg := make([]byte, pageBytes)
	ok, err = s.Get(keys(s, "p2", "nope", "p0"), []Page{{dst[0][:100], dst[0][100:]}, {dst[1]}, {seg[:4096], seg[4096:]}})
	copy(dst[2], seg)
	require.NoError(t, err)
	require.Equal(t, []bool{true, false, true}, ok)
	require.True(t, bytes.Equal(page(2), dst[0]))
	require.True(t, bytes.Equal(page(0), dst[2]))
	require.NoError(t, s.Close())

	s = open(t, dir, 8, "model=a")
	defer func() { require.NoError(t, s.Close()) }()
	require.Equal(t, 3, s.Stats().Recovered)
	require.Equal(t, 3, s.Exists(keys(s, "p0", "p1", "p2")))
	ok, err = s.Get(keys(s, "p1"), pg(dst[0]))
	require.NoError(t, err)
	require.Equal(t, []bool{true}, ok)
	require.True(t, bytes.Equal(page(1), dst[0]))
}

func TestIdentitySeparatesKeysAndFiles(t *testing.T) {
	dir := privateDir(t)
	a := open(t, dir, 4, "model=a")
	_, err := a.Put(keys(a, "p0"), pg(page(0)))
	require.NoError(t, err)
	require.NoError(t, a.Close())
	b := open(t, dir, 4, "model=b")
	defer func() { require.NoError(t, b.Close()) }()
	require.NotEqual(t, a.Path(), b.Path())
	require.Equal(t, 0, b.Exists(keys(b, "p0")), "another identity never sees the page")
	require.NotEqual(t, KeyOf(Fingerprint("model=a"), []byte("p0")), KeyOf(Fingerprint("model=b"), []byte("p0")))
}

// corrupt flips a byte of the payload of the slot holding key.
func corrupt(t *testing.T, s *Store, key Key) {
	t.Helper()
	s.mu.Lock()
	i := s.index[key]
	s.mu.Unlock()
	f, err := os.OpenFile(s.Path(), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	slot := int64(storage.HeaderBytes) + s.d.Stride()
	off := int64(i)*slot + storage.HeaderBytes + 100
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	b[0] ^= 0xff
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
}

func TestCorruptPageIsMissingNeverReturned(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(fmt.Sprintf("restart=%v", restart), func(t *testing.T) {
			dir := privateDir(t)
			s := open(t, dir, 4, "model=a")
			_, err := s.Put(keys(s, "p0", "p1"), pg(page(0), page(1)))
			require.NoError(t, err)
			if restart {
				require.NoError(t, s.Close())
				s = open(t, dir, 4, "model=a") // recovered pages: the MAC is checked at first load
			}
			corrupt(t, s, s.Key([]byte("p0")))
			dst := [][]byte{make([]byte, pageBytes), make([]byte, pageBytes)}
			ok, err := s.Get(keys(s, "p0", "p1"), pg(dst...))
			require.NoError(t, err)
			require.Equal(t, []bool{false, true}, ok)
			require.False(t, bytes.Equal(page(0), dst[0]) && ok[0])
			require.Equal(t, int64(1), s.Stats().Corrupt)
			require.Equal(t, 0, s.Exists(keys(s, "p0")), "a page that failed is dropped")
			require.NoError(t, s.Close())
			s = open(t, dir, 4, "model=a")
			defer func() { require.NoError(t, s.Close()) }()
			require.Equal(t, 0, s.Exists(keys(s, "p0")), "and not recovered")
			require.Equal(t, 1, s.Exists(keys(s, "p1")))
		})
	}
}

func TestEvictsLeastRecentlyUsed(t *testing.T) {
	s := open(t, privateDir(t), 2, "model=a")
	defer func() { require.NoError(t, s.Close()) }()
	_, err := s.Put(keys(s, "p0", "p1"), pg(page(0), page(1)))
	require.NoError(t, err)
	_, err = s.Get(keys(s, "p0"), pg(make([]byte, pageBytes))) // p1 is now the oldest
	require.NoError(t, err)
	ok, err := s.Put(keys(s, "p2"), pg(page(2)))
	require.NoError(t, err)
	require.Equal(t, []bool{true}, ok)
	require.Equal(t, 1, s.Exists(keys(s, "p0")))
	require.Equal(t, 0, s.Exists(keys(s, "p1")))
	require.Equal(t, 1, s.Exists(keys(s, "p2")))
	require.Equal(t, int64(1), s.Stats().Evictions)
}

func TestClearAndBadPageSize(t *testing.T) {
	dir := privateDir(t)
	s := open(t, dir, 2, "model=a")
	_, err := s.Put(keys(s, "p0"), pg(page(0)))
	require.NoError(t, err)
	_, err = s.Put(keys(s, "p1"), pg(make([]byte, 10)))
	require.ErrorContains(t, err, "want 5000")
	require.NoError(t, s.Clear())
	require.Equal(t, 0, s.Exists(keys(s, "p0")))
	require.NoError(t, s.Close())
	s = open(t, dir, 2, "model=a")
	defer func() { require.NoError(t, s.Close()) }()
	require.Equal(t, 0, s.Stats().Recovered, "a cleared page does not come back")
}

// fakeObjects is an object tier in memory (goext/object's own tests cover
// the real store against an S3 server).
type fakeObjects struct {
	mu   sync.Mutex
	objs map[uint64][]byte
}

func (f *fakeObjects) Enqueue(h, _ uint64, p []byte) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.objs[h] = bytes.Clone(p)
	return true
}

func (f *fakeObjects) Download(_ context.Context, h uint64, dst []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.objs[h]
	if !ok {
		return errors.New("not found")
	}
	copy(dst, p)
	return nil
}

func (f *fakeObjects) Lookup(_ context.Context, hs []uint64) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, h := range hs {
		if _, ok := f.objs[h]; !ok {
			return i
		}
	}
	return len(hs)
}

// TestObjectTierSharesPagesAcrossStores: a page one store put is found and
// read by another store (another host's disk) through the object tier, then
// kept on that store's disk; a page corrupt on disk is read from the object
// tier instead.
func TestObjectTierSharesPagesAcrossStores(t *testing.T) {
	objs := &fakeObjects{objs: map[uint64][]byte{}}
	openObj := func(dir string) *Store {
		s, err := Open(Options{Dir: dir, NumPages: 4, PageBytes: pageBytes, Identity: "model=a", Persist: true,
			DisableODirect: true, Key: testKey(t, "pagestore test secret"), Object: objs,
			Logger: slog.New(slog.NewTextHandler(t.Output(), nil))})
		require.NoError(t, err)
		return s
	}
	a := openObj(privateDir(t))
	defer func() { require.NoError(t, a.Close()) }()
	ok, err := a.Put(keys(a, "p0", "p1"), pg(page(0), page(1)))
	require.NoError(t, err)
	require.Equal(t, []bool{true, true}, ok)
	require.Equal(t, int64(2), a.Stats().ObjectUploads)

	b := openObj(privateDir(t))
	defer func() { require.NoError(t, b.Close()) }()
	require.Equal(t, 2, b.Exists(keys(b, "p0", "p1", "p2")))
	require.Equal(t, []bool{false, true, true}, b.Has(keys(b, "p2", "p1", "p0")), "key by key, from the object tier")
	dst := [][]byte{make([]byte, pageBytes), make([]byte, pageBytes)}
	ok, err = b.Get(keys(b, "p1", "p0"), pg(dst...))
	require.NoError(t, err)
	require.Equal(t, []bool{true, true}, ok)
	require.Equal(t, page(1), dst[0])
	require.Equal(t, page(0), dst[1])
	st := b.Stats()
	require.Equal(t, int64(2), st.ObjectHits)
	require.Equal(t, 2, st.Used, "downloaded pages are kept on disk")

	corrupt(t, a, a.Key([]byte("p0")))
	ok, err = a.Get(keys(a, "p0"), pg(dst[0]))
	require.NoError(t, err)
	require.Equal(t, []bool{true}, ok)
	require.Equal(t, page(0), dst[0])
	require.Equal(t, int64(1), a.Stats().Corrupt)
	require.Equal(t, int64(1), a.Stats().ObjectHits)
}

// TestConcurrentPutGetUnderEviction: writers and readers on overlapping keys
// in a store much smaller than the key set (constant eviction): every read
// that succeeds returns its key's page, never another's or a torn one.
func TestConcurrentPutGetUnderEviction(t *testing.T) {
	s := open(t, privateDir(t), 4, "model=a")
	defer func() { require.NoError(t, s.Close()) }()
	const nkeys, rounds = 12, 60
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 4 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for r := range rounds {
				k := (r*7 + w) % nkeys
				if _, err := s.Put(keys(s, fmt.Sprint(k)), pg(page(k))); err != nil {
					errs <- err
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			dst := make([]byte, pageBytes)
			for r := range rounds {
				k := (r*5 + w) % nkeys
				ok, err := s.Get(keys(s, fmt.Sprint(k)), pg(dst))
				if err != nil {
					errs <- err
					return
				}
				if ok[0] && !bytes.Equal(dst, page(k)) {
					errs <- fmt.Errorf("key %d: read another page", k)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := s.Stats()
	require.LessOrEqual(t, st.Used, 4)
	require.Positive(t, st.Evictions)
	require.Zero(t, st.Corrupt)
}

// recordSink records the events a store publishes.
type recordSink struct {
	mu  sync.Mutex
	evs []string
}

func (r *recordSink) Publish(ev events.BlockEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	op := "store"
	if ev.Removed {
		op = "remove"
	}
	r.evs = append(r.evs, fmt.Sprintf("%s %x %v %v", op, ev.SeqHash, ev.Holder, ev.ByHash))
}

func (r *recordSink) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.evs
	r.evs = nil
	return out
}

// TestEventsHasAndCollector: a store announces its pages by their event
// hash (stored, evicted, corrupt, cleared; a recovered page once it is
// read), Has answers key by key, and the collector exports its counters.
func TestEventsHasAndCollector(t *testing.T) {
	dir := t.TempDir()
	sink := &recordSink{}
	o := Options{Dir: dir, NumPages: 2, PageBytes: pageBytes, Identity: "events", Persist: true,
		DisableODirect: true, Key: testKey(t, "pagestore test secret"), Events: sink}
	s, err := Open(o)
	require.NoError(t, err)
	ext := func(h uint64) []Ext { return []Ext{{Hash: h, OK: true}} }
	_, err = s.PutExt(keys(s, "a"), ext(0xa), pg(page(1)))
	require.NoError(t, err)
	_, err = s.PutExt(keys(s, "a"), ext(0xa), pg(page(1))) // a duplicate: no second store
	require.NoError(t, err)
	_, err = s.PutExt(keys(s, "b"), nil, pg(page(2))) // no event hash: not announced
	require.NoError(t, err)
	_, err = s.PutExt(keys(s, "c"), ext(0xc), pg(page(3))) // evicts a
	require.NoError(t, err)
	require.Equal(t, []string{"store a KvbmDisk true", "remove a KvbmDisk true", "store c KvbmDisk true"}, sink.take())
	require.Equal(t, []bool{false, true, true}, s.Has(keys(s, "a", "b", "c")))

	c := NewCollector()
	c.Add("kv", s)
	require.Equal(t, 2.0, testutil.ToFloat64(metricOf(t, c, "kvbm_pagestore_pages_used")))
	require.Equal(t, 1.0, testutil.ToFloat64(metricOf(t, c, "kvbm_pagestore_evictions")))
	require.NoError(t, s.Close())

	// Reopened: the recovered pages are announced once they are read or
	// put again with their event hash.
	s, err = Open(o)
	require.NoError(t, err)
	defer s.Close()
	require.Empty(t, sink.take())
	dst := make([]byte, pageBytes)
	ok, err := s.GetExt(keys(s, "c"), ext(0xc), pg(dst))
	require.NoError(t, err)
	require.Equal(t, []bool{true}, ok)
	_, err = s.PutExt(keys(s, "b"), ext(0xb), pg(page(2)))
	require.NoError(t, err)
	require.Equal(t, []string{"store c KvbmDisk true", "store b KvbmDisk true"}, sink.take())
	require.NoError(t, s.Clear())
	require.ElementsMatch(t, []string{"remove c KvbmDisk true", "remove b KvbmDisk true"}, sink.take())
}

// metricOf is collector c's single series named name.
func metricOf(t *testing.T, c *Collector, name string) prometheus.Collector {
	t.Helper()
	r := prometheus.NewPedanticRegistry()
	require.NoError(t, r.Register(c))
	mfs, err := r.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1)
			require.Equal(t, "kv", mf.GetMetric()[0].GetLabel()[0].GetValue())
			return gaugeFrom(mf)
		}
	}
	t.Fatalf("no %s", name)
	return nil
}

func gaugeFrom(mf *dto.MetricFamily) prometheus.Collector {
	m := mf.GetMetric()[0]
	v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
	g.Set(v)
	return g
}
