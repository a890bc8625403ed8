package pool

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/plan"
)

type recSink struct{ evs []events.BlockEvent }

func (r *recSink) Publish(ev events.BlockEvent) { r.evs = append(r.evs, ev) }

// fill allocates one block, registers it under h with the given priority and
// releases it, leaving it inactive. It returns the block index.
func fill(t *testing.T, p *Pool, h uint64, prio int) int {
	t.Helper()
	got := p.Allocate(1, nil)
	require.Len(t, got, 1, "allocate for hash %d", h)
	idx, dup := p.Register(got[0], h, h-1, h > 1, []uint32{uint32(h)}, prio)
	require.False(t, dup)
	p.Release(idx)
	return idx
}

func TestMatchContiguousPrefix(t *testing.T) {
	p := New(plan.G2, 8, nil, events.HolderKvbmHost)
	for _, h := range []uint64{10, 11, 13} {
		fill(t, p, h, 0)
	}
	tests := []struct {
		name   string
		hashes []uint64
		want   int
	}{
		{"empty query", nil, 0},
		{"first miss", []uint64{99, 10}, 0},
		{"full hit", []uint64{10, 11}, 2},
		{"stops at gap, later hit ignored", []uint64{10, 11, 12, 13}, 2},
		{"single", []uint64{13}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := p.Match(tc.hashes, nil)
			require.Len(t, got, tc.want)
			require.Equal(t, tc.want, p.MatchLen(tc.hashes))
			for i, idx := range got {
				require.True(t, p.Holds(idx, tc.hashes[i]))
			}
		})
	}
}

func TestEvictionOrder(t *testing.T) {
	type reg struct {
		hash uint64
		prio int
	}
	tests := []struct {
		name  string
		cap   int
		regs  []reg    // registered and released in this order (ticks ascending)
		touch []uint64 // touched after registration, in order
		pin   []uint64
		alloc int
		// evicted hashes in eviction order
		want []uint64
	}{
		{
			name: "never-used blocks first", cap: 4,
			regs:  []reg{{1, 0}, {2, 0}},
			alloc: 2, want: nil,
		},
		{
			name: "then LRU within a priority", cap: 3,
			regs:  []reg{{1, 0}, {2, 0}, {3, 0}},
			alloc: 2, want: []uint64{1, 2},
		},
		{
			name: "lowest priority before older blocks", cap: 3,
			regs:  []reg{{1, 5}, {2, 1}, {3, 5}},
			alloc: 3, want: []uint64{2, 1, 3},
		},
		{
			name: "touch refreshes the tick", cap: 3,
			regs:  []reg{{1, 0}, {2, 0}, {3, 0}},
			touch: []uint64{1},
			alloc: 3, want: []uint64{2, 3, 1},
		},
		{
			name: "pinned never evicted, fewer returned", cap: 3,
			regs:  []reg{{1, 0}, {2, 0}, {3, 0}},
			pin:   []uint64{1, 3},
			alloc: 3, want: []uint64{2},
		},
		{
			name: "negative priorities order too", cap: 2,
			regs:  []reg{{1, 0}, {2, -3}},
			alloc: 1, want: []uint64{2},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sink := &recSink{}
			p := New(plan.G2, tc.cap, sink, events.HolderKvbmHost)
			for _, r := range tc.regs {
				fill(t, p, r.hash, r.prio)
			}
			for _, h := range tc.touch {
				idx, ok := p.Lookup(h)
				require.True(t, ok)
				p.Touch(idx)
			}
			for _, h := range tc.pin {
				idx, ok := p.Lookup(h)
				require.True(t, ok)
				p.Pin(idx)
			}
			sink.evs = nil
			got := p.Allocate(tc.alloc, nil)
			wantN := min(tc.alloc, tc.cap-len(tc.pin))
			require.Len(t, got, wantN)
			var evicted []uint64
			for _, ev := range sink.evs {
				require.True(t, ev.Removed)
				require.Equal(t, events.HolderKvbmHost, ev.Holder)
				evicted = append(evicted, ev.SeqHash)
			}
			require.Equal(t, tc.want, evicted)
			require.Equal(t, uint64(len(tc.want)), p.Evictions())
			for _, h := range tc.want {
				_, ok := p.Lookup(h)
				require.False(t, ok, "evicted hash %d still registered", h)
			}
			for _, h := range tc.pin {
				_, ok := p.Lookup(h)
				require.True(t, ok, "pinned hash %d evicted", h)
			}
		})
	}
}

func TestRegisterEventsAndDedupe(t *testing.T) {
	sink := &recSink{}
	p := New(plan.G3, 4, sink, events.HolderKvbmDisk)
	toks := []uint32{1, 2, 3, 4}
	a := p.Allocate(2, nil)
	idx, dup := p.Register(a[0], 100, 7, true, toks, 3)
	require.False(t, dup)
	require.Equal(t, a[0], idx)
	toks[0] = 99 // the pool keeps its own copy
	require.Equal(t, []events.BlockEvent{{
		Holder: events.HolderKvbmDisk, SeqHash: 100, Parent: 7, HasParent: true,
		Tokens: []uint32{1, 2, 3, 4}, BlockSize: 4,
	}}, sink.evs)

	// Same hash again from another writer: the existing block wins, the new
	// one is freed, no second store event.
	idx2, dup := p.Register(a[1], 100, 7, true, []uint32{1, 2, 3, 4}, 3)
	require.True(t, dup)
	require.Equal(t, a[0], idx2)
	require.Len(t, sink.evs, 1)
	require.Equal(t, Free, p.Info(a[1]).State)
	require.Equal(t, 2, p.Info(a[0]).Refs, "both writers hold the survivor")
	require.Equal(t, 3, p.NumFree())

	p.Release(idx)
	p.Release(idx2)
	require.Equal(t, 1, p.NumInactive())
	info := p.Info(idx)
	require.Equal(t, Registered, info.State)
	require.Equal(t, 3, info.Priority)
}

func TestInvalidate(t *testing.T) {
	sink := &recSink{}
	p := New(plan.G2, 3, sink, events.HolderKvbmHost)
	inactive := fill(t, p, 1, 0)
	pinned := fill(t, p, 2, 0)
	p.Pin(pinned)
	sink.evs = nil

	idx, ok := p.Invalidate(1)
	require.True(t, ok)
	require.Equal(t, inactive, idx)
	require.Equal(t, Free, p.Info(idx).State)

	idx, ok = p.Invalidate(2)
	require.True(t, ok)
	require.Equal(t, pinned, idx)
	require.Equal(t, Allocated, p.Info(idx).State, "a pinned block waits for its release")
	require.Zero(t, p.MatchLen([]uint64{2}))
	p.Unpin(pinned)
	require.Equal(t, Free, p.Info(pinned).State)

	_, ok = p.Invalidate(3)
	require.False(t, ok)
	require.Equal(t, []events.BlockEvent{
		{Removed: true, Holder: events.HolderKvbmHost, SeqHash: 1, BlockSize: 1},
		{Removed: true, Holder: events.HolderKvbmHost, SeqHash: 2, BlockSize: 1},
	}, sink.evs)
	require.Equal(t, 3, p.NumFree())
	require.Zero(t, p.NumInactive())
}

func TestInvalidateAll(t *testing.T) {
	sink := &recSink{}
	p := New(plan.G2, 4, sink, events.HolderKvbmHost)
	for h := uint64(1); h <= 3; h++ {
		fill(t, p, h, 0)
	}
	sink.evs = nil
	got := p.InvalidateAll(nil)
	require.Len(t, got, 3)
	require.Len(t, sink.evs, 3)
	require.Zero(t, p.NumRegistered())
	require.Equal(t, 4, p.NumFree())
}

func TestReleaseUnregisteredReturnsToFreeList(t *testing.T) {
	p := New(plan.G2, 2, nil, events.HolderKvbmHost)
	got := p.Allocate(2, nil)
	require.Zero(t, p.NumFree())
	p.Release(got[0])
	require.Equal(t, 1, p.NumFree())
	require.Panics(t, func() { p.Release(got[0]) })
	require.Panics(t, func() { p.Pin(got[0]) })
}

func TestZeroCapacity(t *testing.T) {
	p := New(plan.G3, 0, events.NopSink{}, events.HolderKvbmDisk)
	require.Empty(t, p.Allocate(3, nil))
	require.Zero(t, p.MatchLen([]uint64{1}))
}

// TestEvictionInvariantRandomized drives random operations and checks that
// every eviction takes the minimum (priority, tick) among inactive blocks.
func TestEvictionInvariantRandomized(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const n = 64
	p := New(plan.G2, n, nil, events.HolderKvbmHost)
	next := uint64(1)
	pins := map[int]int{}
	for step := 0; step < 2000; step++ {
		switch op := r.IntN(4); op {
		case 0, 1: // allocate + register + release
			want := -1
			if p.NumFree() == 0 {
				for idx := range p.blocks {
					b := &p.blocks[idx]
					if b.state != Registered || b.refs > 0 {
						continue
					}
					if w := &p.blocks[max(want, 0)]; want < 0 || b.priority < w.priority ||
						(b.priority == w.priority && b.tick < w.tick) {
						want = idx
					}
				}
			}
			got := p.Allocate(1, nil)
			if len(got) == 0 {
				require.Equal(t, -1, want)
				require.Zero(t, p.NumInactive())
				continue
			}
			if want >= 0 {
				require.Equal(t, want, got[0], "evicted the minimum (priority, tick)")
			}
			idx, _ := p.Register(got[0], next, 0, false, nil, r.IntN(3))
			next++
			p.Release(idx)
		case 2: // pin or unpin a random registered block
			idx := r.IntN(n)
			if pins[idx] > 0 {
				p.Unpin(idx)
				pins[idx]--
			} else if p.Info(idx).State == Registered {
				p.Pin(idx)
				pins[idx]++
			}
		case 3:
			idx := r.IntN(n)
			if p.Info(idx).State == Registered {
				p.Touch(idx)
			}
		}
		// Lists: linked blocks are exactly the inactive ones, each list
		// sorted by tick.
		linked := 0
		for _, l := range p.lists {
			var last uint64
			for i := l.head; i >= 0; i = p.blocks[i].next {
				b := &p.blocks[i]
				require.True(t, b.linked)
				require.Equal(t, l.priority, b.priority)
				require.Zero(t, b.refs)
				require.Greater(t, b.tick, last)
				last = b.tick
				linked++
			}
		}
		require.Equal(t, p.NumInactive(), linked)
	}
}

func BenchmarkAllocateEvict(b *testing.B) {
	const n = 100_000
	p := New(plan.G2, n, nil, events.HolderKvbmHost)
	h := uint64(1)
	for range n {
		got := p.Allocate(1, nil)
		idx, _ := p.Register(got[0], h, 0, false, nil, int(h%4))
		p.Release(idx)
		h++
	}
	buf := make([]int, 0, 1)
	b.ResetTimer()
	for b.Loop() {
		got := p.Allocate(1, buf[:0])
		idx, _ := p.Register(got[0], h, 0, false, nil, int(h%4))
		p.Release(idx)
		h++
	}
}
