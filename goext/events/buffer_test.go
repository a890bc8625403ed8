package events

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestBufferDrainsInOrderAndBoundsItsEvents(t *testing.T) {
	b := NewBuffer(3)
	for i := range 5 {
		b.Publish(BlockEvent{SeqHash: uint64(i + 1), Holder: HolderKvbmHost})
	}
	got := b.Drain()
	require.Len(t, got, 3)
	require.Equal(t, []uint64{1, 2, 3}, []uint64{got[0].SeqHash, got[1].SeqHash, got[2].SeqHash})
	require.Equal(t, uint64(2), b.Dropped())
	require.Empty(t, b.Drain(), "a drain empties the buffer")
	b.Publish(BlockEvent{SeqHash: 9, Removed: true})
	got = b.Drain()
	require.Len(t, got, 1)
	require.True(t, got[0].Removed)
}

type recSink []BlockEvent

func (r *recSink) Publish(ev BlockEvent) { *r = append(*r, ev) }

func TestTeePublishesToEverySink(t *testing.T) {
	var a, c recSink
	b := NewBuffer(0)
	Tee{&a, b, &c}.Publish(BlockEvent{SeqHash: 7})
	require.Len(t, a, 1)
	require.Len(t, c, 1)
	require.Len(t, b.Drain(), 1)
}
