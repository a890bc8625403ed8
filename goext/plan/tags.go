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
//
// A tag holds request contents (the block's tokens, and hashes of them), so
// it travels only inside the engine's own step plans, which carry the
// requests' tokens to the workers anyway. Side-channel operations (goext/wire)
// never carry one: they name tags by TagRef.
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
	for i := range ts {
		dst = appendTag(dst, &ts[i])
	}
	return dst
}

func appendTag(dst []byte, t *BlockTag) []byte {
	le := binary.LittleEndian
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

// HostTag is the tag of a G2 block that an engine step's Saves write, sent
// when G2→G3 moves run as side-channel operations (the leader's background
// mode) on a persistent disk tier. Workers keep it with the G2 block until
// the block is written again or dropped; a later operation's TagRef hands it
// to the block's G3 copy. BlockTag.Block is the G2 block.
type HostTag struct {
	// ID is opaque: a number the leader hands out once per G2 registration,
	// never derived from the block's contents.
	ID uint64
	BlockTag
}

// TagRef is how a side-channel operation tags a G3 write without carrying
// request contents: G3 block Block takes the HostTag of its move's G2
// source, if that tag's ID is ID (else the write is not kept beyond the
// process).
type TagRef struct {
	Block int64 // G3 block: the DstBlock of one of the step's G2→G3 Moves
	ID    uint64
}

// Wire format of Step.HostTags (key "ht"): a msgpack bin of records, each
// the id u64 (little-endian) followed by the block tag as in Step.Tags.
// Step.TagRefs (key "tr"): a msgpack bin of tagRefBytes-sized records,
// G3 block i64 and id u64, little-endian.
const tagRefBytes = 16

func appendHostTags(dst []byte, ts []HostTag) []byte {
	for i := range ts {
		dst = binary.LittleEndian.AppendUint64(dst, ts[i].ID)
		dst = appendTag(dst, &ts[i].BlockTag)
	}
	return dst
}

func parseHostTags(b []byte) ([]HostTag, error) {
	var ts []HostTag
	for len(b) > 0 {
		if len(b) < 8+tagFixed {
			return nil, fmt.Errorf("host tag %d: %d bytes left, want at least %d", len(ts), len(b), 8+tagFixed) // errprefix: wrapped by Decode
		}
		id := binary.LittleEndian.Uint64(b)
		n := uint64(binary.LittleEndian.Uint32(b[8+tagFixed-4:]))
		size := 8 + tagFixed + 4*n
		if size > uint64(len(b)) {
			return nil, fmt.Errorf("host tag %d: %d tokens in %d bytes", len(ts), n, len(b)-8-tagFixed) // errprefix: wrapped by Decode
		}
		one, err := parseTags(b[8:size])
		if err != nil {
			return nil, fmt.Errorf("host tag %d: %w", len(ts), err) // errprefix: wrapped by Decode
		}
		ts = append(ts, HostTag{ID: id, BlockTag: one[0]})
		b = b[size:]
	}
	return ts, nil
}

func appendTagRefs(dst []byte, rs []TagRef) []byte {
	for _, r := range rs {
		dst = binary.LittleEndian.AppendUint64(dst, uint64(r.Block))
		dst = binary.LittleEndian.AppendUint64(dst, r.ID)
	}
	return dst
}

func parseTagRefs(b []byte) ([]TagRef, error) {
	if len(b)%tagRefBytes != 0 {
		return nil, fmt.Errorf("tag reference list of %d bytes is not a multiple of %d", len(b), tagRefBytes) // errprefix: wrapped by Decode
	}
	if len(b) == 0 {
		return nil, nil
	}
	rs := make([]TagRef, len(b)/tagRefBytes)
	for i := range rs {
		r := b[i*tagRefBytes:]
		rs[i] = TagRef{Block: int64(binary.LittleEndian.Uint64(r)), ID: binary.LittleEndian.Uint64(r[8:])}
	}
	return rs, nil
}
