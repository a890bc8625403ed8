package object

import (
	"container/list"
	"sync"
)

// Registry is a bounded set of sequence hashes known to be stored (LRU:
// the least recently added or confirmed hash goes first). Safe for
// concurrent use.
type Registry struct {
	cap int

	mu sync.Mutex // guards the fields below
	ll *list.List // front: most recent
	m  map[uint64]*list.Element
}

// NewRegistry returns an empty registry of at most capacity hashes (≥ 1).
func NewRegistry(capacity int) *Registry {
	return &Registry{cap: max(capacity, 1), ll: list.New(), m: make(map[uint64]*list.Element)}
}

// Add records h as stored.
func (r *Registry) Add(h uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.m[h]; ok {
		r.ll.MoveToFront(e)
		return
	}
	r.m[h] = r.ll.PushFront(h)
	for r.ll.Len() > r.cap {
		e := r.ll.Back()
		r.ll.Remove(e)
		delete(r.m, e.Value.(uint64))
	}
}

// Contains reports whether h is known to be stored.
func (r *Registry) Contains(h uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.m[h]
	return ok
}

// PrefixLen is the number of leading hashes known to be stored.
func (r *Registry) PrefixLen(hashes []uint64) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, h := range hashes {
		if _, ok := r.m[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// Remove forgets h (a failed or corrupt download).
func (r *Registry) Remove(h uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.m[h]; ok {
		r.ll.Remove(e)
		delete(r.m, h)
	}
}

// Len is the number of hashes held.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ll.Len()
}
