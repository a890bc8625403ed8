package leader

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/object"
)

// memG4 is an in-memory G4Store: a set of stored hashes behind the
// registry, and switches for the bucket check and the breaker. Its Lookup
// asks the "network" (stored) for what the registry does not know, as
// object.Store does, without a server.
type memG4 struct {
	reg         *object.Registry
	ready       atomic.Bool
	unavailable atomic.Bool
	broken      atomic.Bool // breaker open
	mu          sync.Mutex
	stored      map[uint64]bool
	lookups     int
}

func newMemG4(ready bool) *memG4 {
	m := &memG4{reg: object.NewRegistry(1000), stored: map[uint64]bool{}}
	m.ready.Store(ready)
	return m
}

func (m *memG4) Registry() *object.Registry { return m.reg }
func (m *memG4) Ready() bool                { return m.ready.Load() }
func (m *memG4) Unavailable() bool          { return m.unavailable.Load() }
func (m *memG4) Available() bool            { return !m.broken.Load() }

func (m *memG4) Lookup(_ context.Context, hashes []uint64) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.lookups++
	n := m.reg.PrefixLen(hashes)
	for _, h := range hashes[n:] {
		if !m.stored[h] {
			break
		}
		m.reg.Add(h)
		n++
	}
	return n
}

// LookupSalted: the fake keeps one namespace (salted keys are the object
// store's concern, tested in goext/object).
func (m *memG4) LookupSalted(ctx context.Context, _ uint64, hashes []uint64) int {
	return m.Lookup(ctx, hashes)
}

// PurgeAll forgets every stored hash; the salted purges and the expiry
// sweep are exercised against a real server (purge_test.go).
func (m *memG4) PurgeAll(context.Context, bool) (object.PurgeResult, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var r object.PurgeResult
	r.Listed = len(m.stored)
	r.Deleted = len(m.stored)
	m.stored = map[uint64]bool{}
	return r, nil
}

func (m *memG4) PurgeSalt(context.Context, uint64) (object.PurgeResult, error) {
	return object.PurgeResult{}, nil
}

func (m *memG4) PurgeHashes(_ context.Context, _ uint64, hashes []uint64) (object.PurgeResult, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var r object.PurgeResult
	for _, h := range hashes {
		if m.stored[h] {
			delete(m.stored, h)
			r.Deleted++
		}
		r.Listed++
	}
	return r, nil
}

func (m *memG4) Sweep(context.Context, time.Time, time.Duration, int, string) (string, object.PurgeResult, error) {
	return "", object.PurgeResult{}, nil
}

func (m *memG4) store(hs ...uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, h := range hs {
		m.stored[h] = true
	}
}

var _ G4Store = (*object.Store)(nil)

// TestG4FakeReadyAndUnavailable: G4 is on once the store is ready; while its
// bucket check fails nothing matches in G4, though the registry knows the
// blocks; when it recovers they match again.
func TestG4FakeReadyAndUnavailable(t *testing.T) {
	s := newMemG4(false)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	require.False(t, e.l.G4On())
	s.ready.Store(true)
	require.True(t, e.l.G4On())

	prompt := toks(300, 13)
	for _, h := range seqHashes(prompt) {
		s.Registry().Add(h)
	}
	s.unavailable.Store(true)
	n, _ := e.l.GetNumNewMatchedTokens("a", prompt, 0, 0)
	require.Equal(t, 0, n, "G4 off while the store is unavailable")
	s.unavailable.Store(false)
	n, _ = e.l.GetNumNewMatchedTokens("b", prompt, 0, 0)
	require.Equal(t, 3*bs, n)
}

// TestG4FakeAsyncLookup: an async engine is told Pending while the lookup
// runs, then the blocks the store holds; with the breaker open no lookup
// goes out and only the registry answers.
func TestG4FakeAsyncLookup(t *testing.T) {
	s := newMemG4(true)
	e := newG4Env(t, 16, &G4Options{Store: s, Async: true, WriteThrough: true})
	prompt := toks(500, 9)
	hs := seqHashes(prompt)
	s.store(hs...)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, Pending, n)
	deadline := time.Now().Add(30 * time.Second)
	for n == Pending {
		require.True(t, time.Now().Before(deadline), "lookup never finished")
		time.Sleep(time.Millisecond)
		n, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	}
	require.Equal(t, 2*bs, n)

	s2 := newMemG4(true)
	s2.broken.Store(true)
	s2.store(hs...)
	e2 := newG4Env(t, 16, &G4Options{Store: s2, Async: true, WriteThrough: true})
	n, _ = e2.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 0, n, "breaker open: the registry alone answers")
	s2.mu.Lock()
	require.Equal(t, 0, s2.lookups)
	s2.mu.Unlock()
}
