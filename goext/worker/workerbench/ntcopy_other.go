//go:build !amd64

package workerbench

// HaveNT reports whether the non-temporal-store baseline exists on this
// architecture (kvbm's own copy uses plain stores here too).
const HaveNT = false

func ntCopy(dst, src []byte) { copy(dst, src) }
