//go:build 386 || amd64 || amd64p32 || arm || arm64 || loong64 || mips64le || mips64p32le || mipsle || ppc64le || riscv || riscv64 || wasm

package hashing

import "unsafe"

// scratchBuf is the per-call encoding buffer. Little-endian machines need
// none (see tokenBytes), so it has size zero and costs nothing on the stack.
type scratchBuf [0]byte

// tokenBytes returns the little-endian u32 encoding of tokens.
//
// On little-endian machines the in-memory representation of []uint32 already
// is that encoding, so we reinterpret the memory instead of copying: hashing a
// 32K-token prompt then reads each byte exactly once. The result aliases
// tokens and must not be retained (xxh3 does not retain its input).
func tokenBytes(tokens []uint32, _ *scratchBuf) []byte {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), len(tokens)*4)
}
