package layout

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	tN  = 10 // blocks
	tBS = 4  // block size
	tH  = 3  // kv heads
	tD  = 8  // head dim
	tL  = 3  // layers
)

func perLayer(shape, strides []int64) []Tensor {
	ts := make([]Tensor, tL)
	for i := range ts {
		ts[i] = Tensor{Ptr: uintptr(0x100000 * (i + 1)), Shape: shape, Strides: strides}
	}
	return ts
}

// elemOffset is the brute-force reference: the offset in elements of index idx.
func elemOffset(shape, strides []int64, idx []int64) int64 {
	st := normStrides(Tensor{Shape: shape, Strides: strides})
	var off int64
	for i := range idx {
		off += idx[i] * st[i]
	}
	return off
}

func TestNewEngineKinds(t *testing.T) {
	// HND physical storage behind the NHD logical shape: [2, N, bs, H, D]
	// with the H and bs strides swapped.
	hnd := []int64{tN * tH * tBS * tD, tH * tBS * tD, tD, tBS * tD, 1}
	// Blocks padded to twice their size (page_size_padded).
	padded := []int64{4 * tBS * tH * tD, tBS * tH * tD, tH * tD, tD, 1}
	cases := []struct {
		name      string
		kind      Kind // hint passed in
		want      Kind
		tensors   []Tensor
		outer     int
		inner     int64
		layers    int
		index     func(b, l, o int) (tensor int, idx []int64)
		shape     []int64
		strides   []int64
		numBlocks int
	}{
		{name: "flash_attn auto", want: FlashAttn, shape: []int64{2, tN, tBS, tH, tD}, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(o), int64(b), 0, 0, 0} }},
		{name: "flash_attn HND strides", want: FlashAttn, shape: []int64{2, tN, tBS, tH, tD}, strides: hnd, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(o), int64(b), 0, 0, 0} }},
		{name: "flashinfer auto", want: FlashInfer, shape: []int64{tN, 2, tBS, tH, tD}, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(b), int64(o), 0, 0, 0} }},
		{name: "flashinfer padded blocks", want: FlashInfer, shape: []int64{tN, 2, tBS, tH, tD}, strides: padded, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(b), int64(o), 0, 0, 0} }},
		{name: "cpu auto", want: CPU, shape: []int64{2, tN, tH, tBS, tD}, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(o), int64(b), 0, 0, 0} }},
		{name: "cpu hinted, heads == block_size", kind: CPU, want: CPU, shape: []int64{2, tN, tBS, tBS, tD}, outer: 2, inner: tBS * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(o), int64(b), 0, 0, 0} }},
		{name: "mla auto", want: MLA, shape: []int64{tN, tBS, 576}, outer: 1, inner: 576, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(b), 0, 0} }},
		{name: "trtllm auto", want: TRTLLM, outer: 2, inner: tH * tD, layers: 5,
			tensors: []Tensor{{Ptr: 0x7000, Shape: []int64{tN, 5, 2, tH * tBS * tD}}},
			index:   func(b, l, o int) (int, []int64) { return 0, []int64{int64(b), int64(l), int64(o), 0} }},
		{name: "block dim larger than num_blocks", want: FlashAttn, shape: []int64{2, tN + 6, tBS, tH, tD}, outer: 2, inner: tH * tD, layers: tL,
			index: func(b, l, o int) (int, []int64) { return l, []int64{int64(o), int64(b), 0, 0, 0} }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts := tc.tensors
			if ts == nil {
				ts = perLayer(tc.shape, tc.strides)
			}
			e, err := NewEngine(Spec{Kind: tc.kind, Tensors: ts, NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2})
			require.NoError(t, err)
			require.Equal(t, tc.want, e.Kind)
			require.Equal(t, tc.outer, e.OuterDim)
			require.Equal(t, tc.inner, e.InnerDim)
			require.Equal(t, tc.layers, e.NumLayers)
			require.Equal(t, int64(tBS)*tc.inner*2, e.ChunkBytes)
			require.Equal(t, int64(tc.layers*tc.outer)*e.ChunkBytes, e.BytesPerBlock())

			// Every chunk sits where the strides say, and chunks never overlap.
			type span struct{ lo, hi uintptr }
			var spans []span
			for b := 0; b < tN; b++ {
				for l := 0; l < e.NumLayers; l++ {
					for o := 0; o < e.OuterDim; o++ {
						ti, idx := tc.index(b, l, o)
						st := ts[ti].Strides
						want := ts[ti].Ptr + uintptr(elemOffset(ts[ti].Shape, st, idx)*2)
						require.Equal(t, want, e.ChunkAddr(b, l, o), "block %d layer %d outer %d", b, l, o)
						a := e.ChunkAddr(b, l, o)
						require.LessOrEqual(t, int64(a-ts[ti].Ptr)+e.ChunkBytes, e.TensorBytes())
						spans = append(spans, span{a, a + uintptr(e.ChunkBytes)})
					}
				}
			}
			for i := range spans {
				for j := i + 1; j < len(spans); j++ {
					overlap := spans[i].lo < spans[j].hi && spans[j].lo < spans[i].hi
					require.False(t, overlap, "chunks %d and %d overlap", i, j)
				}
			}
		})
	}
}

func TestNewEngineErrors(t *testing.T) {
	fa := []int64{2, tN, tBS, tH, tD}
	cases := []struct {
		name string
		spec Spec
		want string
	}{
		{"no tensors", Spec{NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "no KV tensors"},
		{"zero blocks", Spec{Tensors: perLayer(fa, nil), BlockSize: tBS, DtypeBytes: 2}, "num_blocks=0"},
		{"zero block size", Spec{Tensors: perLayer(fa, nil), NumBlocks: tN, DtypeBytes: 2}, "block_size=0"},
		{"zero dtype", Spec{Tensors: perLayer(fa, nil), NumBlocks: tN, BlockSize: tBS}, "dtype_bytes=0"},
		{"mixed shapes", Spec{Tensors: append(perLayer(fa, nil), Tensor{Ptr: 1, Shape: []int64{2, tN, tBS, tH * 2, tD}}),
			NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "mixed per-layer KV shapes"},
		{"rank 2", Spec{Tensors: perLayer([]int64{tN, 100}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "cannot interpret KV tensor shape"},
		{"no block dim", Spec{Tensors: perLayer([]int64{3, 3, tBS, tH, tD}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "cannot find the block dimension"},
		{"fa or cpu", Spec{Tensors: perLayer([]int64{2, tN, tBS, tBS, tD}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "pass the layout kind"},
		{"block size nowhere", Spec{Tensors: perLayer([]int64{2, tN, 5, 6, tD}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "neither dimension 2 nor 3"},
		{"N is 2", Spec{Tensors: perLayer([]int64{2, 2, tBS, tH, tD}, nil), NumBlocks: 2, BlockSize: tBS, DtypeBytes: 2}, "pass the layout kind"},
		{"fewer blocks than num_blocks", Spec{Kind: FlashAttn, Tensors: perLayer(fa, nil), NumBlocks: tN + 1, BlockSize: tBS, DtypeBytes: 2}, "fewer than num_blocks"},
		{"wrong block size for kind", Spec{Kind: CPU, Tensors: perLayer(fa, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "should be block_size=4"},
		{"kind rank mismatch", Spec{Kind: MLA, Tensors: perLayer(fa, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "3-dimensional"},
		{"outer not 2", Spec{Kind: FlashInfer, Tensors: perLayer([]int64{tN, 3, tBS, tH, tD}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "K/V"},
		{"chunk not dense", Spec{Tensors: perLayer(fa, []int64{tN * tBS * tH * tD * 2, tBS * tH * tD * 2, tH * tD * 2, tD * 2, 2}),
			NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "not dense"},
		{"chunks overlap", Spec{Tensors: perLayer(fa, []int64{tBS * tH * tD, 1, tH * tD, tD, 1}),
			NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "overlap"},
		{"blocks overlap", Spec{Tensors: perLayer(fa, []int64{tN * tBS * tH * tD, tBS * tH * tD / 2, tH * tD, tD, 1}),
			NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "overlap"},
		{"strides rank", Spec{Tensors: perLayer(fa, []int64{1, 2}), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "strides"},
		{"trtllm two tensors", Spec{Kind: TRTLLM, Tensors: []Tensor{{Shape: []int64{tN, 2, 2, 96}}, {Shape: []int64{tN, 2, 2, 96}}},
			NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "one tensor for all layers"},
		{"trtllm inner not divisible", Spec{Tensors: []Tensor{{Shape: []int64{tN, 2, 2, 97}}}, NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "do not divide"},
		{"negative dim", Spec{Tensors: perLayer([]int64{2, tN, tBS, -1, tD}, nil), NumBlocks: tN, BlockSize: tBS, DtypeBytes: 2}, "dimension 3 = -1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewEngine(tc.spec)
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrLayout))
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestHostLayout(t *testing.T) {
	h := Host{NumLayers: 3, OuterDim: 2, ChunkBytes: 100}
	require.Equal(t, int64(600), h.BytesPerBlock())
	require.Equal(t, int64(0), h.ChunkOffset(0, 0))
	require.Equal(t, int64(100), h.ChunkOffset(0, 1))
	require.Equal(t, int64(500), h.ChunkOffset(2, 1))
	require.Equal(t, int64(4096), h.Stride(4096))
	require.Equal(t, int64(600), h.Stride(1))
	require.Equal(t, int64(8192), AlignUp(4097, 4096))
	require.Equal(t, int64(4096), AlignUp(4096, 4096))
}

func TestParseKind(t *testing.T) {
	for _, k := range []Kind{Auto, FlashAttn, FlashInfer, CPU, MLA, TRTLLM} {
		got, err := ParseKind(k.String())
		require.NoError(t, err)
		require.Equal(t, k, got)
	}
	got, err := ParseKind("")
	require.NoError(t, err)
	require.Equal(t, Auto, got)
	_, err = ParseKind("paged")
	require.ErrorContains(t, err, `"paged"`)
}

func TestOrderLayers(t *testing.T) {
	names := []string{"model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"}
	order, err := OrderLayers(names)
	require.NoError(t, err)
	require.Equal(t, []int{2, 1, 0}, order)

	for _, bad := range [][]string{
		{"model.layers.attn"},
		{"model.layers.1.experts.2"},
		{"model.layers.1.attn", "decoder.1.attn"},
	} {
		_, err := OrderLayers(bad)
		require.Error(t, err, fmt.Sprint(bad))
	}
}

func TestCPUPagedLayout(t *testing.T) {
	// vLLM 0.32 CPU backend: per layer [N, H, bs, 2D], contiguous; one page per (block, layer).
	const n, h, bs, d = 64, 2, 32, 32
	base := uintptr(1 << 20)
	page := int64(h * bs * 2 * d * 4)
	e, err := NewEngine(Spec{
		Kind:      CPUPaged,
		Tensors:   []Tensor{{Ptr: base, Shape: []int64{n, h, bs, 2 * d}}, {Ptr: base + uintptr(n*page), Shape: []int64{n, h, bs, 2 * d}}},
		NumBlocks: n, BlockSize: bs, DtypeBytes: 4,
	})
	if err != nil {
		t.Fatal(err)
	}
	if e.OuterDim != 1 || e.ChunkBytes != page || e.NumLayers != 2 {
		t.Fatalf("outer %d chunk %d layers %d", e.OuterDim, e.ChunkBytes, e.NumLayers)
	}
	if got := e.ChunkAddr(5, 1, 0); got != base+uintptr(n*page)+uintptr(5*page) {
		t.Fatalf("chunk addr %#x", got)
	}
	if k, _ := ParseKind("cpu_paged"); k != CPUPaged {
		t.Fatal("parse")
	}
}

func TestLayerGroups(t *testing.T) {
	shape := []int64{2, 8, 4, 16, 8}
	ts := []Tensor{{Ptr: 4096, Shape: shape}, {Ptr: 4096, Shape: shape}, {Ptr: 1 << 20, Shape: shape}, {Ptr: 1 << 20, Shape: shape}}
	spec := Spec{Kind: CPU, Tensors: ts, NumBlocks: 8, BlockSize: 16, DtypeBytes: 2}
	e, err := NewEngine(spec)
	require.NoError(t, err)
	require.Equal(t, 1, e.NumGroups())
	require.Nil(t, e.LayerGroups())

	spec.LayerGroups = []int{0, 1, 0, 1}
	e, err = NewEngine(spec)
	require.NoError(t, err)
	require.Equal(t, 2, e.NumGroups())
	require.Equal(t, 1, e.LayerGroup(3))
	require.Contains(t, e.String(), "2 KV cache groups")

	spec.LayerGroups = []int{0, 0, 0, 0} // one group: as without groups
	e, err = NewEngine(spec)
	require.NoError(t, err)
	require.Equal(t, 1, e.NumGroups())
	require.Nil(t, e.LayerGroups())

	for _, bad := range [][]int{{0, 1}, {0, 2, 0, 2}, {0, -1, 0, 1}} {
		spec.LayerGroups = bad
		_, err = NewEngine(spec)
		require.ErrorIs(t, err, ErrLayout, "%v", bad)
	}

	// Group kinds: one per group, kept with several groups only.
	spec.LayerGroups = []int{0, 1, 0, 1}
	spec.GroupKinds = []string{"full_attention", "sliding_window(64)"}
	e, err = NewEngine(spec)
	require.NoError(t, err)
	require.Equal(t, []string{"full_attention", "sliding_window(64)"}, e.GroupKinds())
	spec.GroupKinds = []string{"full_attention"}
	_, err = NewEngine(spec)
	require.ErrorIs(t, err, ErrLayout)
	spec.LayerGroups = nil
	e, err = NewEngine(spec)
	require.NoError(t, err)
	require.Nil(t, e.GroupKinds())
}
