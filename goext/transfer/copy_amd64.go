package transfer

import "unsafe"

// copyNT copies n bytes (n a multiple of 128, dst 16-byte aligned) with
// non-temporal stores. Implemented in copy_amd64.s.
//
//go:noescape
func copyNT(dst, src unsafe.Pointer, n uintptr)

// ntMin is the smallest chunk copied with non-temporal stores. Below it the
// fence and the alignment fix-ups cost more than the stores save.
const ntMin = 4096

// useNT can be switched off by tests and benchmarks to compare.
var useNT = true

// HaveNonTemporal reports whether CopyNonTemporal uses non-temporal stores
// on this architecture.
const HaveNonTemporal = true

// CopyNonTemporal copies src into dst (same length): the 128-byte-multiple
// body that starts at the first 16-byte-aligned byte of dst with
// non-temporal stores (fenced before it returns), the rest with copy.
func CopyNonTemporal(dst, src []byte) {
	n := len(src)
	if n == 0 {
		return
	}
	_ = dst[n-1]
	head := min(n, int((16-uintptr(unsafe.Pointer(&dst[0]))&15)&15))
	copy(dst[:head], src[:head])
	body := (n - head) &^ 127
	if body > 0 {
		copyNT(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), uintptr(body))
	}
	copy(dst[head+body:n], src[head+body:n])
}

// copyChunk copies src into dst (same length). Chunks are tens of KiB that
// nobody reads again soon, so large ones bypass the cache: plain stores would
// first read every destination line (read-for-ownership) and evict useful
// data. Measured here: scattered 32 KiB chunks, ~10% more per core.
func copyChunk(dst, src []byte) {
	if !useNT || len(src) < ntMin {
		copy(dst, src)
		return
	}
	CopyNonTemporal(dst, src)
}
