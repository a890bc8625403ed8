package plan

import (
	"encoding/binary"
	"fmt"
)

// BlockTag describes the block a G3 write stores, for a disk tier that
// outlives the process (it records the tag next to the bytes and gives it
// back to the next leader). The leader attaches one per G3 destination of
// a step's Moves and Saves when the disk tier is persistent; a G3 write
// without a tag is not kept beyond the process.
type BlockTag struct {
	Block     int64 // G3 block index (the copy's DstBlock)
	SeqHash   uint64
	Parent    uint64
	HasParent bool
	Priority  int32
	Tokens    []uint32
}

// Wire format of Step.Tags (key "t"): a msgpack bin of records, each
// block i64, seq hash u64, parent u64, flags u8 (bit 0: has parent),
// priority i32, token count u32, then the tokens as u32, all little-endian.
const tagFixed = 8 + 8 + 8 + 1 + 4 + 4

// AppendTags appends the wire form of ts to dst.
func AppendTags(dst []byte, ts []BlockTag) []byte {
	le := binary.LittleEndian
	for _, t := range ts {
		dst = le.AppendUint64(dst, uint64(t.Block))
		dst = le.AppendUint64(dst, t.SeqHash)
		dst = le.AppendUint64(dst, t.Parent)
		var f byte
		if t.HasParent {
			f = 1
		}
		dst = append(dst, f)
		dst = le.AppendUint32(dst, uint32(t.Priority))
		dst = le.AppendUint32(dst, uint32(len(t.Tokens)))
		for _, tok := range t.Tokens {
			dst = le.AppendUint32(dst, tok)
		}
	}
	return dst
}

// ParseTags reads what AppendTags wrote; malformed input is an error.
func ParseTags(b []byte) ([]BlockTag, error) {
	ts, err := parseTags(b)
	if err != nil {
		return nil, fmt.Errorf("plan: %w", err)
	}
	return ts, nil
}

// parseTags is ParseTags without the package prefix, for Decode, which adds
// its own.
func parseTags(b []byte) ([]BlockTag, error) {
	le := binary.LittleEndian
	var ts []BlockTag
	for len(b) > 0 {
		if len(b) < tagFixed {
			return nil, fmt.Errorf("block tag %d: %d bytes left, want at least %d", len(ts), len(b), tagFixed) // errprefix: wrapped by ParseTags and Decode
		}
		t := BlockTag{
			Block: int64(le.Uint64(b[0:])), SeqHash: le.Uint64(b[8:]), Parent: le.Uint64(b[16:]),
			HasParent: b[24]&1 != 0, Priority: int32(le.Uint32(b[25:])),
		}
		n := uint64(le.Uint32(b[29:]))
		b = b[tagFixed:]
		if n*4 > uint64(len(b)) {
			return nil, fmt.Errorf("block tag %d: %d tokens in %d bytes", len(ts), n, len(b)) // errprefix: wrapped by ParseTags and Decode
		}
		if n > 0 {
			t.Tokens = make([]uint32, n)
			for k := range t.Tokens {
				t.Tokens[k] = le.Uint32(b[4*k:])
			}
		}
		b = b[4*n:]
		ts = append(ts, t)
	}
	return ts, nil
}
