package leader

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/object"
)

// g4Held replays G4 tier events as a router would: a store of a block
// already held, or a removal of a block not held, fails the test.
func g4Held(t *testing.T, held map[uint64]bool, evs []events.BlockEvent) {
	t.Helper()
	for _, ev := range evs {
		require.Equal(t, events.HolderKvbmObject, ev.Holder)
		if ev.Removed {
			require.True(t, held[ev.SeqHash], "removal of %x, never stored", ev.SeqHash)
			delete(held, ev.SeqHash)
		} else {
			require.False(t, held[ev.SeqHash], "%x stored twice", ev.SeqHash)
			held[ev.SeqHash] = true
		}
	}
}

func registryHashes(r *object.Registry, hs []uint64) map[uint64]bool {
	m := map[uint64]bool{}
	for _, h := range hs {
		if r.Contains(h) {
			m[h] = true
		}
	}
	return m
}

// TestG4RegistryEvents: the leader's G4 events follow its registry: what it
// held at start, uploads reported by the worker, LRU eviction, a failed
// download, and the switch to rank 0's store's registry; after Close
// nothing more is published.
func TestG4RegistryEvents(t *testing.T) {
	prompt := toks(300, 17) // 4 full blocks + 1 token
	hs := seqHashes(prompt)
	own := object.NewRegistry(3)
	own.Add(hs[0])
	buf := events.NewBuffer(0)
	e := newG4Env(t, 16, &G4Options{Registry: own, WriteThrough: true, Events: buf})
	held := map[uint64]bool{}
	g4Held(t, held, buf.Drain())
	require.Equal(t, map[uint64]bool{hs[0]: true}, held, "the registry's blocks are announced at start")

	e.l.G4Stored(hs[1:4]) // the worker's upload acknowledgements; hs[0] falls out
	evs := buf.Drain()
	g4Held(t, held, evs)
	require.Equal(t, registryHashes(own, hs), held)
	require.False(t, held[hs[0]], "evicted from the registry: removed")
	require.Len(t, evs, 4)

	// A download that fails drops its block from the registry.
	seed(t, e.l.host, prompt, 0)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 4*bs, n)
	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13, 14}, n)
	e.step(t)
	e.l.LoadErrors([]int64{12})
	e.l.LoadsFinished([]string{"r"})
	g4Held(t, held, buf.Drain())
	require.False(t, held[hs[2]], "a failed download is removed")
	require.Equal(t, registryHashes(own, hs), held)

	// Rank 0's store arrives: its registry replaces the leader's own.
	s := g4Store(t, nil)
	s.Registry().Add(hs[3])
	s.Registry().Add(hs[0])
	require.True(t, e.l.SetG4Store(s))
	g4Held(t, held, buf.Drain())
	require.Equal(t, map[uint64]bool{hs[0]: true, hs[3]: true}, held)

	e.l.Close()
	s.Registry().Add(hs[1])
	require.Empty(t, buf.Drain(), "a closed leader publishes nothing")
}
