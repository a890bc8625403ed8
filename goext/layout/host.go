package layout

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Host is the fully contiguous layout of kvbm's host (G2) and disk (G3) tiers:
// [block][layer][outer][chunk bytes]. A whole block (all layers, K and V) is
// one contiguous range, so a block moves to or from disk in one I/O. Chunks
// keep the engine's byte order (see the package comment).
type Host struct {
	NumLayers  int
	OuterDim   int
	ChunkBytes int64
}

// BytesPerBlock is the size of one block's payload.
func (h Host) BytesPerBlock() int64 {
	return int64(h.NumLayers) * int64(h.OuterDim) * h.ChunkBytes
}

// ChunkOffset returns the offset of chunk (layer, outer) from the start of its block.
func (h Host) ChunkOffset(layer, outer int) int64 {
	return (int64(layer)*int64(h.OuterDim) + int64(outer)) * h.ChunkBytes
}

// Stride returns the distance between consecutive blocks when every block
// must start on an align-byte boundary (O_DIRECT needs 4096): BytesPerBlock
// rounded up. align ≤ 1 means no rounding.
func (h Host) Stride(align int64) int64 {
	return AlignUp(h.BytesPerBlock(), align)
}

// AlignUp rounds n up to a multiple of align (align ≤ 1: n unchanged).
func AlignUp(n, align int64) int64 {
	if align <= 1 {
		return n
	}
	return (n + align - 1) / align * align
}

// LayerIndex extracts the layer number from an engine layer name such as
// "model.layers.12.self_attn.attn": the one dot-separated component that is
// an integer. Names with no or several integer components are refused.
func LayerIndex(name string) (int, error) {
	idx, found := -1, 0
	for _, part := range strings.Split(name, ".") {
		if n, err := strconv.Atoi(part); err == nil && n >= 0 {
			idx = n
			found++
		}
	}
	if found != 1 {
		return 0, fmt.Errorf("layout: layer name %q: want exactly one integer component (the layer index), found %d", name, found)
	}
	return idx, nil
}

// OrderLayers returns the positions of names sorted by layer index (design §5:
// layers are ordered by the index in their name, not by dict order).
func OrderLayers(names []string) ([]int, error) {
	idx := make([]int, len(names))
	seen := make(map[int]string, len(names))
	for i, n := range names {
		li, err := LayerIndex(n)
		if err != nil {
			return nil, err
		}
		if prev, dup := seen[li]; dup {
			return nil, fmt.Errorf("layout: layer names %q and %q have the same layer index %d", prev, n, li)
		}
		seen[li] = n
		idx[i] = li
	}
	order := make([]int, len(names))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return idx[a] - idx[b] })
	return order, nil
}
