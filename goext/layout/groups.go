package layout

import "fmt"

// KV cache groups (vLLM's hybrid KV cache manager). A model whose layers
// differ in attention kind (full attention beside sliding-window or chunked
// local attention layers) gets one block table per group of layers; all
// groups draw their blocks from one pool, and layer i of every group shares
// one tensor, each group writing only the blocks it owns. kvbm keeps a
// block as one token position holding every layer, so a copy of a position
// touches, for layer l, the block that l's group holds at that position.

// NoBlock in a group row marks a group that holds no block at the position
// (a sliding-window group's blocks before its window are vLLM's null
// block): its layers are neither read nor written.
const NoBlock = -1

func (e *Engine) setGroups(groups []int, kinds []string) error {
	e.numGroups = 1
	if len(groups) == 0 {
		return nil
	}
	if len(groups) != e.NumLayers {
		return fmt.Errorf("%w: layer_groups has %d entries for %d layers", ErrLayout, len(groups), e.NumLayers)
	}
	n := 0
	for l, g := range groups {
		if g < 0 || g >= e.NumLayers {
			return fmt.Errorf("%w: layer_groups[%d] = %d, want 0..%d", ErrLayout, l, g, e.NumLayers-1)
		}
		n = max(n, g+1)
	}
	seen := make([]bool, n)
	for _, g := range groups {
		seen[g] = true
	}
	for g, ok := range seen {
		if !ok {
			return fmt.Errorf("%w: layer_groups %v has no layer in group %d (groups are numbered 0..n-1)", ErrLayout, groups, g)
		}
	}
	if n == 1 {
		return nil
	}
	if !e.perLayer {
		return fmt.Errorf("%w: KV cache groups need one tensor per layer, the %v layout has one for all layers", ErrLayout, e.Kind)
	}
	if kinds != nil && len(kinds) != n {
		return fmt.Errorf("%w: group_kinds has %d entries for %d KV cache groups", ErrLayout, len(kinds), n)
	}
	e.numGroups = n
	e.layerGroup = append([]int(nil), groups...)
	e.groupKinds = append([]string(nil), kinds...)
	return nil
}

// NumGroups is the number of KV cache groups (1 without groups).
func (e *Engine) NumGroups() int { return e.numGroups }

// LayerGroups returns each layer's group, or nil with one group.
func (e *Engine) LayerGroups() []int { return append([]int(nil), e.layerGroup...) }

// GroupKinds returns each group's attention kind as the adapter named it,
// or nil with one group (or when none were given).
func (e *Engine) GroupKinds() []string { return append([]string(nil), e.groupKinds...) }

// StateKind is the group kind of recurrent-state layers (vLLM's MambaSpec:
// Mamba, Mamba2, short convolution, linear attention, gated delta nets), as
// the vLLM adapter names it. Such a group's block at a position holds the
// layer's state after the position's last token, or nothing.
const StateKind = "mamba"

// StateGroup reports whether group g keeps recurrent state.
func (e *Engine) StateGroup(g int) bool {
	return g < len(e.groupKinds) && e.groupKinds[g] == StateKind
}

// LayerGroup returns layer l's group (0 with one group).
func (e *Engine) LayerGroup(l int) int {
	if e.layerGroup == nil {
		return 0
	}
	return e.layerGroup[l]
}
