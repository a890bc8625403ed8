package pool

// Scans over a pool's blocks for purges and expiry (design §12).

// SetClock makes the pool stamp every registration with now() (Unix
// nanoseconds), which Expired compares against. Restored blocks keep their
// write time.
func (p *Pool) SetClock(now func() int64) { p.clock = now }

// Born is when block idx was registered (Unix ns; 0 without a clock).
func (p *Pool) Born(idx int) int64 { return p.blocks[idx].born }

// Registered appends the index of every registered block (active and
// inactive) to dst, in index order. Cost O(capacity).
func (p *Pool) Registered(dst []int) []int {
	for i := range p.blocks {
		if p.blocks[i].state == Registered {
			dst = append(dst, i)
		}
	}
	return dst
}

// Expired appends to dst the registered blocks among the n block indexes
// starting at from (wrapping around the end) registered before cutoff, and
// returns where the next scan starts. Blocks without a registration time
// never expire. The work is O(n) whatever the pool's size.
func (p *Pool) Expired(cutoff int64, from, n int, dst []int) ([]int, int) {
	c := len(p.blocks)
	if c == 0 {
		return dst, 0
	}
	n = min(n, c)
	i := from % c
	if i < 0 {
		i = 0
	}
	for ; n > 0; n-- {
		b := &p.blocks[i]
		if b.state == Registered && b.born != 0 && b.born < cutoff {
			dst = append(dst, i)
		}
		if i++; i == c {
			i = 0
		}
	}
	return dst, i
}
