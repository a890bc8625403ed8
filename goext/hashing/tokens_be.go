//go:build !(386 || amd64 || amd64p32 || arm || arm64 || loong64 || mips64le || mips64p32le || mipsle || ppc64le || riscv || riscv64 || wasm)

package hashing

import "encoding/binary"

// scratchBuf holds the encoding of one block on big-endian machines. 4 KiB
// covers the largest block size kvbm accepts (1024 tokens), so the usual
// case stays on the stack.
type scratchBuf [4096]byte

// tokenBytes encodes tokens as little-endian u32s into scratch, falling back
// to a heap buffer only for blocks larger than 1024 tokens.
func tokenBytes(tokens []uint32, scratch *scratchBuf) []byte {
	n := len(tokens) * 4
	var b []byte
	if n <= len(scratch) {
		b = scratch[:n]
	} else {
		b = make([]byte, n)
	}
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	return b
}
