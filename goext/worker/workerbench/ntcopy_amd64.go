package workerbench

import "unsafe"

// HaveNT reports whether the non-temporal-store baseline exists on this
// architecture.
const HaveNT = true

//go:noescape
func copyNT(dst, src unsafe.Pointer, n uintptr)

// ntCopy copies src into dst (same length) with non-temporal stores for the
// 128-byte-multiple body that starts at a 16-byte-aligned dst.
func ntCopy(dst, src []byte) {
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
