package object

import (
	"testing"

	"github.com/stretchr/testify/require"
)

type regChange struct {
	h     uint64
	added bool
}

// TestRegistryWatch: a watcher hears every entry and every exit (LRU
// eviction, Remove) in order, never a repeated Add or a Remove of an unknown
// hash, and stop hands back exactly what is held then.
func TestRegistryWatch(t *testing.T) {
	r := NewRegistry(2)
	r.Add(1)
	var got []regChange
	held, stop := r.Watch(func(h uint64, added bool) { got = append(got, regChange{h, added}) })
	require.Equal(t, []uint64{1}, held)

	r.Add(2)
	r.Add(1) // known: refreshed, not announced
	r.Add(3) // evicts 2, the least recent
	r.Remove(9)
	r.Remove(1)
	require.Equal(t, []regChange{{2, true}, {3, true}, {2, false}, {1, false}}, got)

	r.Add(4)
	require.Equal(t, []uint64{3, 4}, stop())
	r.Add(5)
	require.Len(t, got, 5, "no call after stop")
}
