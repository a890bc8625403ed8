package leader

import (
	"slices"

	"github.com/kvbm/kvbm/goext/plan"
)

// KV cache groups (vLLM's hybrid KV cache manager, docs/design.md §11).
//
// The leader plans with the blocks of one group, the primary (a
// full-attention group, which holds a block at every position of a
// prefix). With Options.Groups, every update also carries each group's
// blocks (RequestUpdate.Groups), the leader keeps each request's block
// list per group, and each step's plan carries, for every G1 block it
// copies, the block every group holds at that position (plan.GroupRows):
// the worker copies layer l from or to its group's block. The plan is built
// once, here; the adapter never decodes it.

// noBlock in a group row: the group holds no block there (layout.NoBlock).
const noBlock = -1

// Groups describes the engine's KV cache groups (Options.Groups).
type Groups struct {
	// Primary is the group whose blocks the leader plans with
	// (RequestUpdate.NewBlockIDs are its blocks).
	Primary int
	// Windows, per group: (sliding window, extra retained tokens), or (0,
	// chunk size) for chunked local attention, or (0, 0) for full attention.
	// Its length is the number of groups.
	Windows [][2]int
	// NullBlock is the engine's null block id (vLLM: 0): a group's entry for
	// a position it does not hold.
	NullBlock int64
	// State marks the groups of recurrent state (vLLM's MambaSpec in its
	// "align" mode): a group's block at position j, when not the null block
	// in a step that ends at the position's last token, holds the state
	// after it. nil or all false: attention groups only.
	State []bool
}

// hasState reports whether any group keeps recurrent state.
func (g *Groups) hasState() bool {
	return g != nil && slices.Contains(g.State, true)
}

// isState reports whether group i keeps recurrent state.
func (g *Groups) isState(i int) bool { return i < len(g.State) && g.State[i] }

// GroupBlocks is an update's blocks per group (RequestUpdate.Groups).
type GroupBlocks struct {
	// Replace: Blocks are the request's whole lists (a new or resumed
	// request, or an allocation); otherwise they are appended.
	Replace bool
	// Blocks[g] are group g's block ids.
	Blocks [][]int64
}

// skipped is how many leading blocks of a request group g may have freed
// once computed tokens are computed (vLLM's get_num_skipped_tokens: it frees
// on processed tokens, never more).
func (g *Groups) skipped(group, computed, bs int) int {
	window, extra := g.Windows[group][0], g.Windows[group][1]
	switch {
	case window > 0:
		return max(0, computed-window+1-extra) / bs
	case extra > 0: // chunked local attention: everything before the current chunk
		return (computed / extra) * extra / bs
	}
	return 0
}

// NoteAllocGroups records the blocks every group allocated for a request
// whose load UpdateStateAfterAlloc planned (a request waiting for its load
// is in no update, and the load's group rows come from these). Ignored
// without Options.Groups or for a request the leader does not know.
func (l *Leader) NoteAllocGroups(reqID string, blocks [][]int64) {
	l.mu.Lock()
	defer l.unlock()
	if l.groups == nil {
		return
	}
	if s := l.slots[reqID]; s != nil {
		s.noteGroups(&GroupBlocks{Replace: true, Blocks: blocks}, l.groups.Primary)
	}
}

// noteGroups folds an update's group blocks into s. primary is the group
// the leader plans with.
func (s *slot) noteGroups(gb *GroupBlocks, primary int) {
	if gb == nil || len(gb.Blocks) == 0 {
		return
	}
	if gb.Replace || s.groups == nil || len(s.groups) != len(gb.Blocks) {
		s.groups = make([][]int64, len(gb.Blocks))
		for i, ids := range gb.Blocks {
			s.groups[i] = slices.Clone(ids)
		}
		s.gpos = make(map[int64]int, len(s.groups[primary]))
		for i, b := range s.groups[primary] {
			s.gpos[b] = i
		}
		return
	}
	// Each group's list grows by the blocks added this step (vLLM never
	// reorders a block table; a block leaving a sliding window becomes the
	// null block in its table, which a save never needs again).
	for i, b := range gb.Blocks[primary] {
		s.gpos[b] = len(s.groups[primary]) + i
	}
	for i, ids := range gb.Blocks {
		s.groups[i] = append(s.groups[i], ids...)
	}
}

// groupRow is each group's block at position pos of s: noBlock where
// the engine gave the group its null block, or may have freed it since (a
// block before the window at computed tokens: vLLM does not say when it
// replaces one with the null block). nil when s has no group lists.
func (l *Leader) groupRow(s *slot, pos, computed int) []int64 {
	if s == nil || s.groups == nil {
		return nil
	}
	row := make([]int64, len(s.groups))
	for i, ids := range s.groups {
		if pos < len(ids) && ids[pos] != l.groups.NullBlock && pos >= l.groups.skipped(i, computed, l.bs) {
			row[i] = ids[pos]
		} else {
			row[i] = noBlock
		}
	}
	return row
}

// missesAttention reports whether an attention group holds no block in row
// (a save needs every attention layer; a state group without a block at a
// position simply has no state to store there).
func (l *Leader) missesAttention(row []int64) bool {
	for g, b := range row {
		if b == noBlock && !l.groups.isState(g) {
			return true
		}
	}
	return false
}

func allNoBlock(row []int64) bool {
	return !slices.ContainsFunc(row, func(b int64) bool { return b != noBlock })
}

// addGroupRows gives st a group row for every G1 block it copies: loads
// from their request's block lists, saves from the lists of the requests
// updated this step (only they get saves; computed maps each to its computed
// tokens before the step, the last update of a request counting). A save
// without a complete row fails in the worker (a stored block holds every
// layer) and leaves its destination invalid.
func (l *Leader) addGroupRows(st *plan.Step, updates []RequestUpdate) {
	n := len(l.groups.Windows)
	rows := map[int64][]int64{}
	var order []int64
	set := func(b int64, row []int64) {
		if _, ok := rows[b]; !ok {
			order = append(order, b)
		}
		rows[b] = row
	}
	for _, ld := range st.Loads {
		s := l.slots[ld.ReqID]
		if s == nil {
			continue
		}
		last := -1 // the load's last position: the only one a state group loads
		for _, c := range ld.Copies {
			if pos, ok := s.gpos[c.DstBlock]; ok && c.Dst == plan.G1 {
				last = max(last, pos)
			}
		}
		for _, c := range ld.Copies {
			if c.Dst != plan.G1 {
				continue
			}
			if pos, ok := s.gpos[c.DstBlock]; ok {
				if row := l.groupRow(s, pos, 0); row != nil {
					for g := range row {
						if l.groups.isState(g) && pos != last {
							row[g] = noBlock
						}
					}
					set(c.DstBlock, row)
				}
			}
		}
	}
	var saves []int64
	for _, c := range st.Saves {
		if c.Src == plan.G1 && !slices.Contains(saves, c.SrcBlock) {
			saves = append(saves, c.SrcBlock)
		}
	}
	if len(saves) > 0 {
		computed, ends := map[string]int{}, map[string]int{}
		var ids []string
		for i := range updates {
			u := &updates[i]
			if _, ok := computed[u.ReqID]; !ok {
				ids = append(ids, u.ReqID)
			}
			computed[u.ReqID] = u.NumComputedTokens
			ends[u.ReqID] = u.NumComputedTokens + u.NumScheduledTokens
		}
		for _, id := range ids {
			s := l.slots[id]
			if s == nil || s.gpos == nil {
				continue
			}
			for _, b := range saves {
				pos, ok := s.gpos[b]
				if !ok {
					continue
				}
				row := l.groupRow(s, pos, computed[id])
				if prev, ok := rows[b]; row == nil || ok && allNoBlock(prev) {
					continue
				}
				for g := range row {
					if l.groups.isState(g) && (pos+1)*l.bs != ends[id] {
						// A state block holds the state at this position's end
						// only in the step that ends there (a save retried
						// later would read a block vLLM has since let go).
						row[g] = noBlock
					}
				}
				if l.missesAttention(row) {
					// This request held b at a position some group has freed
					// since: b may be reused by another request now, so the
					// save cannot tell whose bytes it reads. It fails.
					for i := range row {
						row[i] = noBlock
					}
					set(b, row)
				} else if _, ok := rows[b]; !ok {
					set(b, row)
				}
			}
		}
	}
	g := &plan.GroupRows{Groups: n, Rows: make([][]int64, 0, len(order))}
	for _, b := range order {
		g.Rows = append(g.Rows, append([]int64{b}, rows[b]...))
	}
	st.G1Groups = g
}
