package transfer

import "github.com/kvbm/kvbm/goext/layout"

// GatherRows is GatherBlocks for an engine with KV cache groups: item i is
// one token position, rows[i][g] the G1 block group g holds there, and
// layer l is read from rows[i][e.LayerGroup(l)]. Every entry must be a
// block (< e.NumBlocks): a position stored whole has every layer, except
// a recurrent-state group's (e.StateGroup), which may be layout.NoBlock: a
// position without its state there; those layers' bytes are zeroed.
func GatherRows(e *layout.Engine, rows [][]int64, dsts [][]byte) {
	h := e.Host()
	for i := range rows {
		_ = dsts[i][h.BytesPerBlock()-1]
	}
	for l := 0; l < e.NumLayers; l++ {
		g := e.LayerGroup(l)
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			for i, r := range rows {
				if r[g] == layout.NoBlock {
					clear(dsts[i][off : off+e.ChunkBytes])
					continue
				}
				copyChunk(dsts[i][off:off+e.ChunkBytes], bytesAt(e.ChunkAddr(int(r[g]), l, o), e.ChunkBytes))
			}
		}
	}
}

// ScatterRows is ScatterBlocks for an engine with KV cache groups (rows as
// for GatherRows). The layers of a group whose entry is layout.NoBlock are
// not written: that group does not need the position (it lies before a
// sliding window), and the bytes stay in the source.
func ScatterRows(e *layout.Engine, rows [][]int64, srcs [][]byte) {
	h := e.Host()
	for i := range rows {
		_ = srcs[i][h.BytesPerBlock()-1]
	}
	for l := 0; l < e.NumLayers; l++ {
		g := e.LayerGroup(l)
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			for i, r := range rows {
				if r[g] == layout.NoBlock {
					continue
				}
				copyChunk(bytesAt(e.ChunkAddr(int(r[g]), l, o), e.ChunkBytes), srcs[i][off:off+e.ChunkBytes])
			}
		}
	}
}
