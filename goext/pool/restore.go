package pool

// Restored is one block a persistent tier recovered, to register again.
type Restored struct {
	Index     int
	SeqHash   uint64
	Parent    uint64
	HasParent bool
	Tokens    []uint32 // kept (not copied) and never modified
	Priority  int
	Born      int64 // when it was written (Unix ns); 0: now, by the clock
}

// RestoreAll registers recovered blocks at their own indexes, as inactive
// blocks, publishing a store event for each in the order of entries (put
// parents first). lru lists indexes into entries, least recently used
// first: the eviction order among them. An entry whose index is out of
// range or not free, or whose hash is already registered, is skipped. It
// returns how many were registered. Cost O(capacity + entries).
func (p *Pool) RestoreAll(entries []Restored, lru []int) int {
	ok := make([]bool, len(entries))
	n := 0
	for k, e := range entries {
		if e.Index < 0 || e.Index >= len(p.blocks) || p.blocks[e.Index].state != Free || p.blocks[e.Index].refs != 0 {
			continue
		}
		if _, dup := p.registry[e.SeqHash]; dup {
			continue
		}
		p.registerShared(e.Index, e.SeqHash, e.Parent, e.HasParent, e.Tokens, e.Priority)
		if e.Born != 0 {
			p.blocks[e.Index].born = e.Born
		}
		ok[k] = true
		n++
	}
	if n == 0 {
		return 0
	}
	for _, k := range lru {
		if k >= 0 && k < len(entries) && ok[k] && !p.blocks[entries[k].Index].linked {
			p.pushTail(int32(entries[k].Index))
		}
	}
	// Any registered entry lru forgot still becomes evictable.
	for k, e := range entries {
		if ok[k] && !p.blocks[e.Index].linked {
			p.pushTail(int32(e.Index))
		}
	}
	free := p.free[:0]
	for _, i := range p.free {
		if p.blocks[i].state == Free {
			free = append(free, i)
		}
	}
	p.free = free
	return n
}
