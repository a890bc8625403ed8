//go:build !amd64

package transfer

var useNT = false

// HaveNonTemporal reports whether CopyNonTemporal uses non-temporal stores
// on this architecture: not here, it is copy.
const HaveNonTemporal = false

// CopyNonTemporal is copy on this architecture.
func CopyNonTemporal(dst, src []byte) { copy(dst, src) }

func copyChunk(dst, src []byte) { copy(dst, src) }
