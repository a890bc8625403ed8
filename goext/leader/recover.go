package leader

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

// Persistent disk tier (docs/persistent-g3.md): the leader tags every G3
// write with the block it stores (plan.Step.Tags), workers keep the tags in
// the tier file, and a new leader registers the blocks every rank recovered
// (RestoreDisk) before its first step.

// RecoveredBlock is one G3 block a worker's persistent tier recovered.
type RecoveredBlock struct {
	plan.BlockTag
	WrittenAt int64 // Unix nanoseconds: the eviction order among recovered blocks
}

// Reasons a recovered block is not registered (RestoreStats.Skipped).
const (
	SkipRanksDisagree = "ranks_disagree" // not every rank holds this block under the same hash
	SkipDuplicate     = "duplicate"      // an older copy of a hash another block holds
	SkipOutOfRange    = "out_of_range"   // index beyond this leader's disk tier
)

// RestoreStats is what RestoreDisk did.
type RestoreStats struct {
	Registered int
	Skipped    map[string]int
}

// tagSteps reports whether steps carry block tags.
func (l *Leader) tagSteps() bool { return l.persist && l.disk != nil }

// dropPinned: an invalidated G3 block of a persistent tier is dropped even
// while a load pins it. Its contents would otherwise stay recoverable by the
// next process after a cache reset (or a failed load) until rewritten. A
// load from it that has not read it yet fails and is recomputed.
func (l *Leader) dropPinned(p *pool.Pool) bool { return l.persist && p == l.disk }

// tagStep attaches the tags of st's G3 writes planned by Step: their
// destinations are registered when planned. In background mode it also
// attaches the tags of st's G2 saves (plan.HostTag), which the workers keep
// for the side-channel operation that later moves those blocks to G3.
func (l *Leader) tagStep(st *plan.Step) {
	if !l.tagSteps() {
		return
	}
	for _, cs := range [][]plan.Copy{st.Moves, st.Saves} {
		for _, c := range cs {
			if c.Dst != plan.G3 {
				continue
			}
			info := l.disk.Info(int(c.DstBlock))
			if info.State != pool.Registered {
				continue // untagged: the worker keeps it for this process only
			}
			st.Tags = append(st.Tags, blockTag(c.DstBlock, info))
		}
	}
	if !l.bgMode || l.host == nil {
		return
	}
	if l.hostTags == nil {
		l.hostTags = make([]uint64, l.host.Capacity())
	}
	// Any other G2 write (a G4 download or G3 staging into a bounce block)
	// ends the block's tag.
	for _, ld := range st.Loads {
		for _, c := range ld.Copies {
			if c.Dst == plan.G2 {
				l.hostTags[c.DstBlock] = 0
			}
		}
	}
	for _, c := range st.Saves {
		if c.Dst != plan.G2 {
			continue
		}
		l.hostTags[c.DstBlock] = 0
		info := l.host.Info(int(c.DstBlock))
		if info.State != pool.Registered {
			continue
		}
		l.tagSeq++
		l.hostTags[c.DstBlock] = l.tagSeq
		st.HostTags = append(st.HostTags, plan.HostTag{ID: l.tagSeq, BlockTag: blockTag(c.DstBlock, info)})
	}
}

func blockTag(block int64, info pool.BlockInfo) plan.BlockTag {
	return plan.BlockTag{Block: block, SeqHash: info.SeqHash, Parent: info.Parent, HasParent: info.HasParent,
		Priority: int32(info.Priority), Tokens: info.Tokens}
}

// tagBackground tags a background operation's moves, whose destinations are
// registered only at commit. The operation travels over the side channel,
// which must carry no request contents (any local process may subscribe):
// each G3 destination names, by its opaque id, the HostTag its G2 source got
// from the engine step that saved it. A source without one (saved before
// persistence could tag it) leaves its copy untagged.
func (l *Leader) tagBackground(st *plan.Step, op *bgOp) {
	if !l.tagSteps() || l.hostTags == nil {
		return
	}
	for _, mv := range op.moves {
		if id := l.hostTags[mv.entry.idx]; id != 0 {
			st.TagRefs = append(st.TagRefs, plan.TagRef{Block: int64(mv.dst), ID: id})
		}
	}
}

// RestoreDisk registers the G3 blocks the workers' persistent tiers
// recovered: perRank[r] is rank r's list, and a block is registered only
// when every rank holds it at the same index under the same hash and
// parent (each rank holds only its shard). Of two blocks with one hash the
// newer is kept. Store events go to the Sink parents first, so the router
// sees whole chains; the eviction order among the blocks is their write
// time, oldest first. Call it before the first Step; later calls do nothing.
func (l *Leader) RestoreDisk(perRank [][]RecoveredBlock) (RestoreStats, error) {
	l.mu.Lock()
	defer l.unlock()
	st := RestoreStats{Skipped: map[string]int{}}
	if l.disk == nil || len(perRank) == 0 || l.restored {
		return st, nil // restored once already (in process, then through the engine)
	}
	if l.seq != 0 || l.disk.NumRegistered() != 0 || l.disk.NumFree() != l.disk.Capacity() {
		return st, fmt.Errorf("leader: restore of the disk tier after it was used (step %d)", l.seq)
	}
	start := time.Now()
	type key struct {
		block  int64
		hash   uint64
		parent uint64
		hasPar bool
	}
	agree := make(map[key]int, len(perRank[0])) // ranks that hold it
	for _, rank := range perRank {
		for _, b := range rank {
			agree[key{b.Block, b.SeqHash, b.Parent, b.HasParent}]++
		}
	}
	byHash := make(map[uint64]RecoveredBlock, len(perRank[0]))
	for _, b := range perRank[0] {
		switch {
		case agree[key{b.Block, b.SeqHash, b.Parent, b.HasParent}] != len(perRank):
			st.Skipped[SkipRanksDisagree]++
			continue
		case b.Block < 0 || b.Block >= int64(l.disk.Capacity()):
			st.Skipped[SkipOutOfRange]++
			continue
		}
		if old, dup := byHash[b.SeqHash]; dup {
			st.Skipped[SkipDuplicate]++
			if old.WrittenAt >= b.WrittenAt {
				continue
			}
		}
		byHash[b.SeqHash] = b
	}
	blocks := make([]RecoveredBlock, 0, len(byHash))
	for _, b := range byHash {
		blocks = append(blocks, b)
	}
	blocks = l.restoreFilter(blocks, &st) // purged and expired (lifecycle.go)
	clear(byHash)
	for _, b := range blocks {
		byHash[b.SeqHash] = b
	}
	// Parents first: order by depth in the recovered forest.
	depth := recoveredDepths(byHash)
	slices.SortFunc(blocks, func(a, b RecoveredBlock) int {
		return cmp.Or(cmp.Compare(depth[a.SeqHash], depth[b.SeqHash]), cmp.Compare(a.Block, b.Block))
	})
	entries := make([]pool.Restored, len(blocks))
	lru := make([]int, len(blocks))
	for k, b := range blocks {
		entries[k] = pool.Restored{Index: int(b.Block), SeqHash: b.SeqHash, Parent: b.Parent, HasParent: b.HasParent,
			Tokens: b.Tokens, Priority: int(b.Priority), Born: b.WrittenAt}
		lru[k] = k
	}
	slices.SortStableFunc(lru, func(a, b int) int { return cmp.Compare(blocks[a].WrittenAt, blocks[b].WrittenAt) })
	st.Registered = l.disk.RestoreAll(entries, lru)
	l.restored = true
	l.updateGauges()
	l.log.Info("kvbm leader: disk tier blocks recovered from the persistent tier",
		"registered", st.Registered, "ranks", len(perRank), "skipped", fmt.Sprint(st.Skipped),
		"seconds", time.Since(start).Seconds())
	return st, nil
}

// recoveredDepths returns each block's depth in the forest its parent links
// form within byHash (a block whose parent was not recovered is a root, at
// 0). A tier may hold a chain as long as the tier itself (millions of
// blocks), so the walk is iterative: it climbs from a block to the first
// ancestor of known depth, keeping the path in a slice, then numbers the path
// back down. A cycle (only a hash collision makes one) ends where it closes.
func recoveredDepths(byHash map[uint64]RecoveredBlock) map[uint64]int {
	const onPath = -1 // being walked: a link back to it closes a cycle
	depth := make(map[uint64]int, len(byHash))
	var path []uint64
	for h := range byHash {
		if _, ok := depth[h]; ok {
			continue
		}
		path = append(path[:0], h)
		depth[h] = onPath
		base := 0 // depth of the topmost block of path
		for cur := h; ; {
			b := byHash[cur]
			if !b.HasParent {
				break
			}
			if _, ok := byHash[b.Parent]; !ok {
				break
			}
			d, seen := depth[b.Parent]
			if seen {
				base = max(d, 0) + 1 // known, or on the path (a cycle: counted as a root)
				break
			}
			cur = b.Parent
			depth[cur] = onPath
			path = append(path, cur)
		}
		for k := len(path) - 1; k >= 0; k-- {
			depth[path[k]] = base
			base++
		}
	}
	return depth
}
