// Package fingerprint names the properties that make two KV blocks with the
// same sequence hash interchangeable: the same model, element type, KV layout
// and shape, block size, tensor-parallel size and rank, and hashing scheme.
//
// A block stored under one fingerprint must never be loaded under another:
// the sequence hash identifies tokens, not the bytes a model computed for
// them, and a rank's shard holds only its heads. Tiers that outlive a process
// (a persistent disk tier) or are shared by several (object storage) key
// their blocks by fingerprint + sequence hash.
package fingerprint

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/layout"
)

// Inputs are the properties a fingerprint covers.
type Inputs struct {
	// Model identifies the weights: the engine's model name or path, with
	// its revision, hub snapshot commit and a digest of the model's config,
	// index and weight-file heads when the adapter can see them (Python's
	// kvbm._model_digest), so new weights under an old name do not match
	// blocks of the old ones. Opaque here. Empty when the engine gave
	// none; the layout then still separates unrelated models of different
	// shapes, but two models of one architecture would collide, so adapters
	// always pass it.
	Model string
	// DType is the element type's name as the engine spells it (e.g.
	// "torch.bfloat16"): bf16 and fp16 have the same size and different bits.
	DType string
	// Layout is the engine layout (kind, layers, K/V, chunk shape); the
	// number of G1 blocks is not part of it.
	Layout     layout.Kind
	NumLayers  int
	OuterDim   int
	InnerDim   int64
	DtypeBytes int
	BlockSize  int // tokens per block
	TPSize     int
	Rank       int
	// HashScheme is hashing.SchemeVersion unless a test says otherwise.
	HashScheme int
	// LayerGroups is each layer's KV cache group (nil with one group): a
	// block holds layer l as group(l)'s KV, so another grouping of the same
	// layers must not match. One group adds nothing to the digest, so
	// single-group fingerprints are unchanged.
	LayerGroups []int
	// GroupKinds is each group's attention kind with its window (e.g.
	// "sliding_window(1024)"; nil with one group): the KV of a layer
	// depends on the windows of the layers before it, so the same grouping
	// with another window must not match either. Covered only with
	// LayerGroups.
	GroupKinds []string
}

// FromEngine fills the layout fields from a registered engine layout.
func FromEngine(model, dtype string, e *layout.Engine, tpSize, rank int) Inputs {
	return Inputs{
		Model: model, DType: dtype, Layout: e.Kind, NumLayers: e.NumLayers, OuterDim: e.OuterDim,
		InnerDim: e.InnerDim, DtypeBytes: e.DtypeBytes, BlockSize: e.BlockSize,
		TPSize: max(tpSize, 1), Rank: rank, HashScheme: hashing.SchemeVersion, LayerGroups: e.LayerGroups(),
		GroupKinds: e.GroupKinds(),
	}
}

// Fingerprint is a 128-bit digest of Inputs.
type Fingerprint [16]byte

// Sum digests the inputs. Every field is length-prefixed or fixed-width, so
// no two different inputs share an encoding.
func (in Inputs) Sum() Fingerprint {
	var b []byte
	str := func(s string) {
		b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
		b = append(b, s...)
	}
	num := func(v int64) { b = binary.LittleEndian.AppendUint64(b, uint64(v)) }
	str("kvbm-fingerprint-v1")
	str(in.Model)
	str(in.DType)
	str(in.Layout.String())
	for _, v := range []int64{int64(in.NumLayers), int64(in.OuterDim), in.InnerDim, int64(in.DtypeBytes),
		int64(in.BlockSize), int64(in.TPSize), int64(in.Rank), int64(in.HashScheme)} {
		num(v)
	}
	if len(in.LayerGroups) > 0 {
		str("layer-groups")
		num(int64(len(in.LayerGroups)))
		for _, g := range in.LayerGroups {
			num(int64(g))
		}
		if len(in.GroupKinds) > 0 {
			str("group-kinds")
			num(int64(len(in.GroupKinds)))
			for _, k := range in.GroupKinds {
				str(k)
			}
		}
	}
	return Fingerprint(xxh3.Hash128(b).Bytes())
}

// String is the digest in 32 lower-case hex digits (object keys, file names).
func (f Fingerprint) String() string { return hex.EncodeToString(f[:]) }

// IsZero reports whether f is the zero value (no fingerprint known).
func (f Fingerprint) IsZero() bool { return f == Fingerprint{} }

// Parse reads the String form back.
func Parse(s string) (Fingerprint, error) {
	var f Fingerprint
	if len(s) != 2*len(f) {
		return f, fmt.Errorf("fingerprint: %q: want %d hex digits", s, 2*len(f))
	}
	if _, err := hex.Decode(f[:], []byte(strings.ToLower(s))); err != nil {
		return f, fmt.Errorf("fingerprint: %q: %w", s, err)
	}
	return f, nil
}

// Describe is the human-readable form for logs ("why did nothing match").
func (in Inputs) Describe() string {
	return fmt.Sprintf("model=%q dtype=%q layout=%v layers=%d outer=%d inner=%d dtype_bytes=%d block_size=%d tp=%d rank=%d hash_scheme=%d",
		in.Model, in.DType, in.Layout, in.NumLayers, in.OuterDim, in.InnerDim, in.DtypeBytes, in.BlockSize,
		in.TPSize, in.Rank, in.HashScheme) + describeGroups(in.LayerGroups, in.GroupKinds)
}

func describeGroups(g []int, kinds []string) string {
	if len(g) == 0 {
		return ""
	}
	s := fmt.Sprintf(" layer_groups=%v", g)
	if len(kinds) > 0 {
		s += fmt.Sprintf(" group_kinds=%q", kinds)
	}
	return s
}
