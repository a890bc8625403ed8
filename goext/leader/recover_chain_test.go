package leader

import (
	"math/rand/v2"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

// TestRestoreLongChain: a persistent tier that recovered one chain of a
// million blocks (one long conversation kept on disk) is restored parents
// first without walking the chain on the goroutine's stack: the walk runs
// under a 1 MiB stack limit, which a recursive walk exceeds (one frame per
// block).
func TestRestoreLongChain(t *testing.T) {
	if testing.Short() {
		t.Skip("a million-block restore; run without -short")
	}
	const n = 1_000_000
	e := newEnv(t, 0, n, persistOn)
	rec := make([]RecoveredBlock, n)
	for k := range rec {
		rec[k] = RecoveredBlock{BlockTag: plan.BlockTag{Block: int64(k), SeqHash: uint64(k) + 1,
			Parent: uint64(k), HasParent: k > 0}, WrittenAt: int64(k)}
	}
	// Children before parents, in no useful order.
	rand.New(rand.NewPCG(1, 2)).Shuffle(n, func(i, j int) { rec[i], rec[j] = rec[j], rec[i] })

	old := debug.SetMaxStack(1 << 20)
	got, err := e.l.RestoreDisk([][]RecoveredBlock{rec})
	debug.SetMaxStack(old)
	require.NoError(t, err)
	require.Equal(t, n, got.Registered)

	// Announced root first, each block after its parent.
	evs := e.sink.take()
	require.Len(t, evs, n)
	for k, ev := range evs {
		require.Equal(t, uint64(k)+1, ev.SeqHash, "event %d", k)
	}
}

// TestRecoveredDepthsCycle: a cycle of parent links (only a hash collision
// makes one) ends the walk where it closes instead of looping.
func TestRecoveredDepthsCycle(t *testing.T) {
	blk := func(h, parent uint64) RecoveredBlock {
		return RecoveredBlock{BlockTag: plan.BlockTag{SeqHash: h, Parent: parent, HasParent: true}}
	}
	byHash := map[uint64]RecoveredBlock{1: blk(1, 2), 2: blk(2, 1), 3: blk(3, 2), 4: blk(4, 99)}
	d := recoveredDepths(byHash)
	require.Len(t, d, 4)
	require.Equal(t, 0, d[4]) // parent not recovered: a root
	// 1 and 2 are one above the other (which one depends on where the walk
	// entered the cycle), 3 below 2.
	require.Contains(t, []int{-1, 1}, d[1]-d[2])
	require.Equal(t, d[2]+1, d[3])
}
