package layout

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvbm/kvbm/goext/internal/checked"
)

// ErrLayout is wrapped by every error NewEngine returns, so callers can tell
// "the engine handed us tensors we do not understand" from other failures.
var ErrLayout = errors.New("layout: unsupported KV cache layout")

// Tensor is one engine KV tensor as the engine hands it over. The memory at
// Ptr belongs to the engine; layout only computes addresses inside it.
type Tensor struct {
	Ptr     uintptr // address of element [0, 0, ...]
	Shape   []int64
	Strides []int64 // in elements, as torch reports them; nil = contiguous row-major
}

// Spec is what the engine tells kvbm about its KV cache.
type Spec struct {
	// Kind is the backend's layout. Auto detects it from the shapes; pass it
	// explicitly when detection is ambiguous (FlashAttention and the CPU
	// backend are both [2, N, ...] and differ only in where block_size sits).
	Kind Kind
	// Tensors holds one tensor per layer, in layer order (see OrderLayers),
	// or exactly one tensor for TensorRT-LLM.
	Tensors []Tensor
	// NumBlocks is the number of G1 blocks the engine uses. The block
	// dimension of the tensors may be larger (padding, kernel blocks), never
	// smaller.
	NumBlocks  int
	BlockSize  int // tokens per block
	DtypeBytes int // bytes per element
	// LayerGroups, when set, gives each layer's KV cache group (vLLM's
	// hybrid KV cache manager: each group has its own block table, and
	// layers of different groups may share one tensor, each group using its
	// own blocks of it). A block then names one token position, and a copy
	// of layer l reads or writes the block its group holds at that position
	// (see groups.go). nil or all zeros: one group.
	LayerGroups []int
	// GroupKinds names each group's attention kind as the adapter spells it
	// (e.g. "full_attention", "sliding_window(1024)"), in group order. It
	// moves no bytes but is part of the block fingerprint: the KV a layer
	// computes depends on the attention window of every layer before it,
	// so the same layer grouping with another window must not match.
	// Optional; ignored with one group.
	GroupKinds []string
}

// Engine is a validated engine (G1) layout: where each (block, layer, outer)
// chunk lives.
type Engine struct {
	Kind       Kind
	NumLayers  int
	NumBlocks  int
	BlockSize  int
	OuterDim   int   // 2 (K and V) or 1 (MLA latent, or TensorRT-LLM kv_factor 1)
	DtypeBytes int   // bytes per element
	InnerDim   int64 // elements per token inside one chunk (kv_heads × head_dim, or latent dim)
	ChunkBytes int64 // bytes of one (block, layer, outer) chunk = BlockSize × InnerDim × DtypeBytes

	bases       []uintptr // one per tensor
	perLayer    bool      // one tensor per layer; otherwise one tensor with a layer dimension
	blockStride int64     // bytes between consecutive blocks
	outerStride int64     // bytes between K and V of one block (0 when OuterDim is 1)
	layerStride int64     // bytes between layers inside the single tensor (0 when perLayer)
	tensorBytes int64     // bytes a tensor spans from its base to the end of its last chunk
	layerGroup  []int     // each layer's KV cache group; nil with one group
	numGroups   int       // 1 with one group
	groupKinds  []string  // each group's attention kind (Spec.GroupKinds); nil with one group or none given
}

// roles says which dimension of a tensor plays which part for one Kind.
type roles struct {
	rank     int
	block    int   // the num_blocks dimension
	outer    int   // the K/V dimension, -1 if none
	layer    int   // the layer dimension of a single-tensor layout, -1 if none
	token    int   // the block_size dimension, -1 if folded into the last dim
	chunk    []int // dimensions inside one chunk
	outerLen []int64
}

func rolesOf(k Kind) roles {
	switch k {
	case FlashAttn:
		return roles{rank: 5, block: 1, outer: 0, layer: -1, token: 2, chunk: []int{2, 3, 4}, outerLen: []int64{2}}
	case FlashInfer:
		return roles{rank: 5, block: 0, outer: 1, layer: -1, token: 2, chunk: []int{2, 3, 4}, outerLen: []int64{2}}
	case CPU:
		return roles{rank: 5, block: 1, outer: 0, layer: -1, token: 3, chunk: []int{2, 3, 4}, outerLen: []int64{2}}
	case MLA:
		return roles{rank: 3, block: 0, outer: -1, layer: -1, token: 1, chunk: []int{1, 2}}
	case TRTLLM:
		return roles{rank: 4, block: 0, outer: 2, layer: 1, token: -1, chunk: []int{3}, outerLen: []int64{1, 2}}
	case CPUPaged:
		return roles{rank: 4, block: 0, outer: -1, layer: -1, token: 2, chunk: []int{1, 2, 3}}
	}
	return roles{}
}

// maxDim bounds every dimension and stride so that products of a few of them
// cannot overflow int64 (2^40 elements is far beyond any real KV tensor).
const maxDim = 1 << 40

// NewEngine validates an engine layout and derives its chunk geometry.
func NewEngine(s Spec) (*Engine, error) {
	if len(s.Tensors) == 0 {
		return nil, fmt.Errorf("%w: no KV tensors given", ErrLayout)
	}
	if s.NumBlocks <= 0 {
		return nil, fmt.Errorf("%w: num_blocks=%d, want > 0", ErrLayout, s.NumBlocks)
	}
	if s.BlockSize <= 0 {
		return nil, fmt.Errorf("%w: block_size=%d, want > 0", ErrLayout, s.BlockSize)
	}
	if s.DtypeBytes <= 0 || s.DtypeBytes > 16 {
		return nil, fmt.Errorf("%w: dtype_bytes=%d, want 1..16", ErrLayout, s.DtypeBytes)
	}
	first := s.Tensors[0]
	for i, t := range s.Tensors[1:] {
		if !slices.Equal(t.Shape, first.Shape) || !slices.Equal(normStrides(t), normStrides(first)) {
			return nil, fmt.Errorf("%w: mixed per-layer KV shapes: layer 0 has shape %v strides %v, layer %d has shape %v strides %v "+
				"(models whose layers have different KV cache shapes are not supported)",
				ErrLayout, first.Shape, normStrides(first), i+1, t.Shape, normStrides(t))
		}
	}
	for i, d := range first.Shape {
		if d <= 0 || d > maxDim {
			return nil, fmt.Errorf("%w: shape %v has dimension %d = %d", ErrLayout, first.Shape, i, d)
		}
	}
	kind := s.Kind
	if kind == Auto {
		var err error
		if kind, err = detect(s); err != nil {
			return nil, err
		}
	}
	r := rolesOf(kind)
	if r.rank == 0 {
		return nil, fmt.Errorf("%w: unknown layout kind %v", ErrLayout, kind)
	}
	shape := first.Shape
	if len(shape) != r.rank {
		return nil, fmt.Errorf("%w: %v layout wants a %d-dimensional tensor, got shape %v", ErrLayout, kind, r.rank, shape)
	}
	if kind == TRTLLM && len(s.Tensors) != 1 {
		return nil, fmt.Errorf("%w: trtllm layout is one tensor for all layers, got %d tensors", ErrLayout, len(s.Tensors))
	}
	if shape[r.block] < int64(s.NumBlocks) {
		return nil, fmt.Errorf("%w: %v shape %v has %d blocks in dimension %d, fewer than num_blocks=%d",
			ErrLayout, kind, shape, shape[r.block], r.block, s.NumBlocks)
	}
	outerDim := 1
	if r.outer >= 0 {
		if !slices.Contains(r.outerLen, shape[r.outer]) {
			return nil, fmt.Errorf("%w: %v shape %v: dimension %d (K/V) is %d, want one of %v",
				ErrLayout, kind, shape, r.outer, shape[r.outer], r.outerLen)
		}
		outerDim = int(shape[r.outer])
	}
	chunkElems := int64(1)
	for _, d := range r.chunk {
		chunkElems *= shape[d]
		if chunkElems > maxDim {
			return nil, fmt.Errorf("%w: %v shape %v: one block chunk has more than 2^40 elements", ErrLayout, kind, shape)
		}
	}
	if r.token >= 0 && shape[r.token] != int64(s.BlockSize) {
		return nil, fmt.Errorf("%w: %v shape %v: dimension %d should be block_size=%d, is %d",
			ErrLayout, kind, shape, r.token, s.BlockSize, shape[r.token])
	}
	if chunkElems%int64(s.BlockSize) != 0 {
		return nil, fmt.Errorf("%w: %v shape %v: %d elements per chunk do not divide into block_size=%d tokens",
			ErrLayout, kind, shape, chunkElems, s.BlockSize)
	}
	strides := normStrides(first)
	if len(strides) != len(shape) {
		return nil, fmt.Errorf("%w: shape %v has %d dimensions but strides %v have %d", ErrLayout, shape, len(shape), strides, len(strides))
	}
	if err := checkChunkDense(kind, shape, strides, r.chunk); err != nil {
		return nil, err
	}
	outerDims := []int{r.block}
	if r.outer >= 0 {
		outerDims = append(outerDims, r.outer)
	}
	if r.layer >= 0 {
		outerDims = append(outerDims, r.layer)
	}
	if err := checkNoOverlap(kind, shape, strides, outerDims, chunkElems); err != nil {
		return nil, err
	}

	db := int64(s.DtypeBytes)
	e := &Engine{
		Kind:        kind,
		NumBlocks:   s.NumBlocks,
		BlockSize:   s.BlockSize,
		OuterDim:    outerDim,
		DtypeBytes:  s.DtypeBytes,
		InnerDim:    chunkElems / int64(s.BlockSize),
		ChunkBytes:  chunkElems * db,
		blockStride: strides[r.block] * db,
		perLayer:    r.layer < 0,
	}
	if r.outer >= 0 {
		e.outerStride = strides[r.outer] * db
	}
	if e.perLayer {
		e.NumLayers = len(s.Tensors)
	} else {
		e.NumLayers = int(shape[r.layer])
		e.layerStride = strides[r.layer] * db
	}
	// The layers of a per-layer layout are as many as the tensors given, so
	// a block's bytes can exceed 64 bits: a wrapped size would pass every
	// later check.
	if _, ok := checked.Mul(int64(e.NumLayers), int64(outerDim), e.ChunkBytes); !ok {
		return nil, fmt.Errorf("%w: %v shape %v: %d layers × %d (K/V) × %d-byte chunks per block overflows 64 bits",
			ErrLayout, kind, shape, e.NumLayers, outerDim, e.ChunkBytes)
	}
	// checkNoOverlap bounded the extent to 2^40 elements.
	span := chunkElems
	for _, d := range outerDims {
		span += (shape[d] - 1) * strides[d]
	}
	e.tensorBytes = span * db
	e.bases = make([]uintptr, len(s.Tensors))
	for i, t := range s.Tensors {
		e.bases[i] = t.Ptr
	}
	if err := e.setGroups(s.LayerGroups, s.GroupKinds); err != nil {
		return nil, err
	}
	return e, nil
}

// detect picks a Kind from the shapes alone (design §5: a dimension ≥ num_blocks
// marks where the blocks are).
func detect(s Spec) (Kind, error) {
	shape := s.Tensors[0].Shape
	n := int64(s.NumBlocks)
	switch {
	case len(s.Tensors) == 1 && len(shape) == 4:
		return TRTLLM, nil
	case len(shape) == 3:
		return MLA, nil
	case len(shape) == 5:
		blockMajor := shape[0] >= n && shape[1] == 2
		kvMajor := shape[0] == 2 && shape[1] >= n
		switch {
		case blockMajor && kvMajor:
			return Auto, fmt.Errorf("%w: shape %v with num_blocks=%d could be [2, N, ...] or [N, 2, ...]; pass the layout kind",
				ErrLayout, shape, n)
		case blockMajor:
			return FlashInfer, nil
		case kvMajor:
			bs := int64(s.BlockSize)
			fa, cpu := shape[2] == bs, shape[3] == bs
			switch {
			case fa && cpu:
				return Auto, fmt.Errorf("%w: shape %v fits both flash_attn [2, N, block_size, heads, head_dim] and "+
					"cpu [2, N, heads, block_size, head_dim] (heads == block_size == %d); pass the layout kind", ErrLayout, shape, bs)
			case fa:
				return FlashAttn, nil
			case cpu:
				return CPU, nil
			}
			return Auto, fmt.Errorf("%w: shape %v is K/V-major but neither dimension 2 nor 3 is block_size=%d", ErrLayout, shape, bs)
		}
		return Auto, fmt.Errorf("%w: cannot find the block dimension of shape %v: neither [N, 2, ...] nor [2, N, ...] with num_blocks=%d",
			ErrLayout, shape, n)
	}
	return Auto, fmt.Errorf("%w: cannot interpret KV tensor shape %v (%d tensors); known layouts: "+
		"[2,N,bs,H,D] flash_attn, [N,2,bs,H,D] flashinfer, [2,N,H,bs,D] cpu, [N,bs,latent] mla, one [N,L,2,H*bs*D] trtllm",
		ErrLayout, shape, len(s.Tensors))
}

// normStrides returns t's strides, or the row-major strides of its shape.
func normStrides(t Tensor) []int64 {
	if t.Strides != nil {
		return t.Strides
	}
	st := make([]int64, len(t.Shape))
	acc := int64(1)
	for i := len(t.Shape) - 1; i >= 0; i-- {
		st[i] = acc
		acc *= t.Shape[i]
	}
	return st
}

// checkChunkDense requires the chunk dimensions to tile one dense range of
// memory in some order. The order may differ from the logical one (vLLM hands
// over NHD-shaped views of HND storage); since chunks are copied verbatim,
// only density matters.
func checkChunkDense(kind Kind, shape, strides []int64, chunk []int) error {
	type dim struct{ size, stride int64 }
	var ds []dim
	for _, d := range chunk {
		if shape[d] > 1 {
			ds = append(ds, dim{shape[d], strides[d]})
		}
	}
	slices.SortFunc(ds, func(a, b dim) int { return compare(a.stride, b.stride) })
	want := int64(1)
	for _, d := range ds {
		if d.stride != want {
			return fmt.Errorf("%w: %v shape %v strides %v: the dimensions %v of one (block, layer, K/V) chunk are not dense in memory; "+
				"kvbm copies whole chunks and needs them contiguous", ErrLayout, kind, shape, strides, chunk)
		}
		want *= d.size
	}
	return nil
}

// checkNoOverlap requires distinct (block, layer, outer) chunks not to share
// bytes: sorted by stride, each dimension must step over everything inside the
// previous one (padding between blocks is fine).
func checkNoOverlap(kind Kind, shape, strides []int64, dims []int, chunkElems int64) error {
	type dim struct {
		idx          int64
		size, stride int64
	}
	var ds []dim
	for _, d := range dims {
		if strides[d] < 0 || strides[d] > maxDim {
			return fmt.Errorf("%w: %v shape %v has stride %d in dimension %d", ErrLayout, kind, shape, strides[d], d)
		}
		if shape[d] > 1 {
			ds = append(ds, dim{int64(d), shape[d], strides[d]})
		}
	}
	slices.SortFunc(ds, func(a, b dim) int { return compare(a.stride, b.stride) })
	extent := chunkElems
	for _, d := range ds {
		if d.stride < extent {
			return fmt.Errorf("%w: %v shape %v strides %v: dimension %d steps %d elements but one step must cover %d; chunks would overlap",
				ErrLayout, kind, shape, strides, d.idx, d.stride, extent)
		}
		// Both are at most 2^40: the product is checked, not wrapped.
		var ok bool
		if extent, ok = checked.Mul(d.stride, d.size); !ok || extent > maxDim {
			return fmt.Errorf("%w: %v shape %v strides %v span more than 2^40 elements", ErrLayout, kind, shape, strides)
		}
	}
	return nil
}

func compare(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ChunkOffset returns which registered tensor holds chunk (block, layer,
// outer) and the chunk's byte offset from that tensor's base.
func (e *Engine) ChunkOffset(block, layer, outer int) (tensor int, offset int64) {
	off := int64(block)*e.blockStride + int64(outer)*e.outerStride
	if e.perLayer {
		return layer, off
	}
	return 0, off + int64(layer)*e.layerStride
}

// ChunkAddr returns the address of chunk (block, layer, outer). Arguments
// must be in range (block < NumBlocks, layer < NumLayers, outer < OuterDim).
func (e *Engine) ChunkAddr(block, layer, outer int) uintptr {
	t, off := e.ChunkOffset(block, layer, outer)
	return e.bases[t] + uintptr(off)
}

// Tensors returns the number of registered tensors (NumLayers, or 1 for TensorRT-LLM).
func (e *Engine) Tensors() int { return len(e.bases) }

// Base returns the base address of registered tensor i.
func (e *Engine) Base(i int) uintptr { return e.bases[i] }

// TensorBytes returns how many bytes each registered tensor must span from its
// base for every chunk to be inside it.
func (e *Engine) TensorBytes() int64 { return e.tensorBytes }

// Host returns the fully contiguous host/disk layout for this engine's blocks.
func (e *Engine) Host() Host {
	return Host{NumLayers: e.NumLayers, OuterDim: e.OuterDim, ChunkBytes: e.ChunkBytes}
}

// BytesPerBlock is one block's size across all layers on this worker
// (num_layers × outer_dim × block_size × inner_dim × dtype_bytes, design §2).
func (e *Engine) BytesPerBlock() int64 { return e.Host().BytesPerBlock() }

func (e *Engine) String() string {
	s := fmt.Sprintf("%v layout: %d layers × %d outer × %d B chunks (%d tokens × %d elems × %d B), %d blocks, %d B per block",
		e.Kind, e.NumLayers, e.OuterDim, e.ChunkBytes, e.BlockSize, e.InnerDim, e.DtypeBytes, e.NumBlocks, e.BytesPerBlock())
	if e.numGroups > 1 {
		s += fmt.Sprintf(", %d KV cache groups (layer groups %v)", e.numGroups, e.layerGroup)
	}
	return s
}
