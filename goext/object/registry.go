package object

import (
	"container/list"
	"sync"
)

// Registry is a bounded set of sequence hashes known to be stored (LRU:
// the least recently added or confirmed hash goes first). Safe for
// concurrent use. It does not record the salt: a request's salt seeds its
// sequence hashes, so one hash under two salts is a 64-bit collision.
type Registry struct {
	cap int

	mu       sync.Mutex // guards the fields below
	ll       *list.List // front: most recent
	m        map[uint64]*list.Element
	watchers map[int]func(h uint64, added bool)
	nextW    int
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
	r.notify(h, true)
	for r.ll.Len() > r.cap {
		e := r.ll.Back()
		r.ll.Remove(e)
		old := e.Value.(uint64)
		delete(r.m, old)
		r.notify(old, false)
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
		r.notify(h, false)
	}
}

// Watch calls fn for every hash that enters (added) or leaves the registry
// (evicted or removed), in the order of those changes: fn runs under the
// registry's lock, so it must be quick and must not call the registry.
// It returns the hashes held when watching started (least recent first),
// which fn will not be told about, and stop, after which fn is not called;
// stop returns the hashes held then, so that a watcher that announced the
// registry's contents can withdraw exactly them.
func (r *Registry) Watch(fn func(h uint64, added bool)) (held []uint64, stop func() []uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.watchers == nil {
		r.watchers = make(map[int]func(uint64, bool))
	}
	id := r.nextW
	r.nextW++
	r.watchers[id] = fn
	return r.hashes(), func() []uint64 {
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.watchers, id)
		return r.hashes()
	}
}

// hashes lists the registry, least recent first. r.mu held.
func (r *Registry) hashes() []uint64 {
	held := make([]uint64, 0, r.ll.Len())
	for e := r.ll.Back(); e != nil; e = e.Prev() {
		held = append(held, e.Value.(uint64))
	}
	return held
}

// notify tells the watchers about h. r.mu held.
func (r *Registry) notify(h uint64, added bool) {
	for _, fn := range r.watchers {
		fn(h, added)
	}
}

// Len is the number of hashes held.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ll.Len()
}

// RemoveAll forgets every hash (watchers are told about each) and returns
// how many there were.
func (r *Registry) RemoveAll() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.ll.Len()
	for e := r.ll.Back(); e != nil; e = r.ll.Back() {
		h := e.Value.(uint64)
		r.ll.Remove(e)
		delete(r.m, h)
		r.notify(h, false)
	}
	return n
}
