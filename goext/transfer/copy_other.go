//go:build !amd64

package transfer

var useNT = false

func copyChunk(dst, src []byte) { copy(dst, src) }
