package plan

import (
	"encoding/binary"
	"fmt"
)

// GroupRows maps the G1 blocks of a step's copies to the blocks of every KV
// cache group at the same token position (vLLM's hybrid KV cache manager:
// one block table per group of layers). The leader plans with one G1 block
// per position, the block of the primary group (a full-attention group,
// which holds every position); the adapter adds a row per such block, and
// the worker copies each layer from or to its own group's block.
//
// Wire format ("g"): a msgpack bin of little-endian int64s: the number of
// groups n, then one record of 1+n values per row: the primary block, then
// the block of groups 0..n-1 (-1: the group holds no block there, e.g. a
// sliding-window group's positions before its window).
type GroupRows struct {
	Groups int
	Rows   [][]int64 // Rows[i] = [primary, block of group 0, …, block of group Groups-1]
}

// maxGroups bounds the row width a plan may declare.
const maxGroups = 1 << 10

func (r *GroupRows) append(dst []byte) []byte {
	dst = binary.LittleEndian.AppendUint64(dst, uint64(r.Groups))
	for _, row := range r.Rows {
		for _, v := range row {
			dst = binary.LittleEndian.AppendUint64(dst, uint64(v))
		}
	}
	return dst
}

func parseGroupRows(b []byte) (*GroupRows, error) {
	if len(b) < 8 || len(b)%8 != 0 {
		return nil, fmt.Errorf("group rows of %d bytes: want 8 + a multiple of 8", len(b)) // errprefix: wrapped by Decode
	}
	n := binary.LittleEndian.Uint64(b)
	if n < 1 || n > maxGroups {
		return nil, fmt.Errorf("group rows declare %d groups, want 1..%d", n, maxGroups) // errprefix: wrapped by Decode
	}
	vals := (len(b) - 8) / 8
	width := int(n) + 1
	if vals%width != 0 {
		return nil, fmt.Errorf("group rows: %d values do not divide into rows of %d", vals, width) // errprefix: wrapped by Decode
	}
	r := &GroupRows{Groups: int(n), Rows: make([][]int64, vals/width)}
	flat := make([]int64, vals)
	for i := range flat {
		flat[i] = int64(binary.LittleEndian.Uint64(b[8+8*i:]))
	}
	for i := range r.Rows {
		r.Rows[i] = flat[i*width : (i+1)*width : (i+1)*width]
	}
	return r, nil
}

// Map returns primary block → the blocks of every group (nil for a nil r).
// A primary block listed twice keeps its last row.
func (r *GroupRows) Map() map[int64][]int64 {
	if r == nil {
		return nil
	}
	m := make(map[int64][]int64, len(r.Rows))
	for _, row := range r.Rows {
		m[row[0]] = row[1:]
	}
	return m
}
