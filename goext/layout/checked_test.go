package layout

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/internal/checked"
)

// TestNewEngineSizeOverflow: every dimension and stride within bounds, but
// a product of them beyond 64 bits. The sizes used to wrap (to a small or
// negative byte count that later checks accepted); they are an error that
// names the factors.
func TestNewEngineSizeOverflow(t *testing.T) {
	const big = int64(1) << 40 // maxDim
	t.Run("tensor extent", func(t *testing.T) {
		// TensorRT-LLM's one tensor, 2^40 blocks 2^40 elements apart: 2^80
		// elements, which wrapped to 0 and passed the 2^40 bound.
		_, err := NewEngine(Spec{Kind: TRTLLM, NumBlocks: 8, BlockSize: 4, DtypeBytes: 2,
			Tensors: []Tensor{{Ptr: 1, Shape: []int64{big, 1, 2, 64}, Strides: []int64{big, 128, 64, 1}}}})
		require.True(t, errors.Is(err, ErrLayout), "%v", err)
		require.ErrorContains(t, err, "span more than 2^40 elements")
		// 2^34 blocks 2^6 elements apart: exactly 2^40.
		e, err := NewEngine(Spec{Kind: TRTLLM, NumBlocks: 8, BlockSize: 4, DtypeBytes: 2,
			Tensors: []Tensor{{Ptr: 1, Shape: []int64{1 << 34, 1, 1, 64}, Strides: []int64{64, 64, 64, 1}}}})
		require.NoError(t, err)
		require.Equal(t, int64(1)<<41, e.TensorBytes())
	})
	t.Run("bytes per block", func(t *testing.T) {
		// 2^19+1 layers of 2^39-element chunks of 16 bytes, K and V: more
		// than 2^63 bytes a block.
		shape := []int64{2, 1, 4, 1 << 19, 1 << 18}
		strides := []int64{1 << 39, big, 1 << 37, 1 << 18, 1}
		layers := make([]Tensor, 1<<19+1)
		for i := range layers {
			layers[i] = Tensor{Ptr: uintptr(i + 1), Shape: shape, Strides: strides}
		}
		_, err := NewEngine(Spec{Kind: FlashAttn, NumBlocks: 1, BlockSize: 4, DtypeBytes: 16, Tensors: layers})
		require.True(t, errors.Is(err, ErrLayout), "%v", err)
		require.ErrorContains(t, err, "524289 layers × 2 (K/V) × 8796093022208-byte chunks per block overflows 64 bits")
		// One layer less: 2^63 - 2^44 bytes a block, which fits.
		e, err := NewEngine(Spec{Kind: FlashAttn, NumBlocks: 1, BlockSize: 4, DtypeBytes: 16, Tensors: layers[:1<<19-1]})
		require.NoError(t, err)
		require.Equal(t, int64(math.MaxInt64)-(1<<44)+1, e.BytesPerBlock())
	})
}

func TestMulChecked(t *testing.T) {
	for _, tc := range []struct {
		in   []int64
		want int64
		ok   bool
	}{
		{[]int64{2, 3, 7}, 42, true},
		{[]int64{math.MaxInt64}, math.MaxInt64, true},
		{[]int64{1 << 40, 1 << 23}, 0, false}, // 2^63
		{[]int64{1 << 40, 1 << 40}, 0, false},
		{[]int64{-2, 2}, 0, false},
	} {
		got, ok := checked.Mul(tc.in...)
		require.Equal(t, tc.ok, ok, "%v", tc.in)
		if ok {
			require.Equal(t, tc.want, got)
		}
	}
}
