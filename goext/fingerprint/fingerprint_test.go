package fingerprint

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
)

func base() Inputs {
	return Inputs{Model: "tiny", DType: "torch.bfloat16", Layout: layout.FlashAttn, NumLayers: 4, OuterDim: 2,
		InnerDim: 256, DtypeBytes: 2, BlockSize: 16, TPSize: 2, Rank: 0, HashScheme: 1}
}

// Every property that changes the bytes of a block changes the fingerprint.
func TestEveryFieldMatters(t *testing.T) {
	ref := base().Sum()
	require.Equal(t, ref, base().Sum(), "deterministic")
	muts := map[string]func(*Inputs){
		"model":       func(i *Inputs) { i.Model = "tiny2" },
		"dtype":       func(i *Inputs) { i.DType = "torch.float16" },
		"layout":      func(i *Inputs) { i.Layout = layout.FlashInfer },
		"layers":      func(i *Inputs) { i.NumLayers = 5 },
		"outer":       func(i *Inputs) { i.OuterDim = 1 },
		"inner":       func(i *Inputs) { i.InnerDim = 128 },
		"dtype_bytes": func(i *Inputs) { i.DtypeBytes = 4 },
		"block_size":  func(i *Inputs) { i.BlockSize = 32 },
		"tp":          func(i *Inputs) { i.TPSize = 1 },
		"rank":        func(i *Inputs) { i.Rank = 1 },
		"scheme":      func(i *Inputs) { i.HashScheme = 2 },
	}
	seen := map[Fingerprint]string{ref: "base"}
	for name, m := range muts {
		in := base()
		m(&in)
		f := in.Sum()
		prev, dup := seen[f]
		require.False(t, dup, "%s collides with %s", name, prev)
		seen[f] = name
	}
}

// Length prefixes keep "ab"+"c" apart from "a"+"bc".
func TestNoAmbiguousConcatenation(t *testing.T) {
	a, b := base(), base()
	a.Model, a.DType = "ab", "c"
	b.Model, b.DType = "a", "bc"
	require.NotEqual(t, a.Sum(), b.Sum())
}

func TestParseRoundTrip(t *testing.T) {
	f := base().Sum()
	g, err := Parse(f.String())
	require.NoError(t, err)
	require.Equal(t, f, g)
	require.False(t, f.IsZero())
	_, err = Parse("xyz")
	require.Error(t, err)
	_, err = Parse(string(make([]byte, 32)))
	require.Error(t, err)
}

// The layer → KV cache group layout is part of the fingerprint; one group
// leaves the digest as it was.
func TestFingerprintLayerGroups(t *testing.T) {
	base := Inputs{Model: "m", DType: "torch.float16", NumLayers: 4, OuterDim: 2, InnerDim: 64, DtypeBytes: 2, BlockSize: 16,
		TPSize: 1, HashScheme: 1}
	grouped := base
	grouped.LayerGroups = []int{0, 1, 0, 1}
	other := base
	other.LayerGroups = []int{0, 0, 1, 1}
	require.NotEqual(t, base.Sum(), grouped.Sum())
	require.NotEqual(t, grouped.Sum(), other.Sum())
	require.Contains(t, grouped.Describe(), "layer_groups=[0 1 0 1]")
	require.NotContains(t, base.Describe(), "layer_groups")

	// Each group's kind and window count too: the same grouping with
	// another sliding window (or chunked local attention) is another model's KV.
	kinds := func(k ...string) Inputs {
		in := grouped
		in.GroupKinds = k
		return in
	}
	seen := map[Fingerprint]string{grouped.Sum(): "no kinds", other.Sum(): "other grouping"}
	for _, k := range [][]string{{"full_attention", "sliding_window(64)"}, {"full_attention", "sliding_window(128)"},
		{"full_attention", "chunked_local(64)"}, {"sliding_window(64)", "full_attention"}} {
		f := kinds(k...).Sum()
		prev, dup := seen[f]
		require.False(t, dup, "%v collides with %s", k, prev)
		seen[f] = fmt.Sprint(k)
	}
	require.Contains(t, kinds("full_attention", "sliding_window(64)").Describe(),
		`group_kinds=["full_attention" "sliding_window(64)"]`)
	single := base
	single.GroupKinds = []string{"sliding_window(64)"} // without LayerGroups: as before
	require.Equal(t, base.Sum(), single.Sum())
}
