// Package mpbound checks a msgpack value against its own length before a
// decoder allocates anything for it. msgpack decoders size buffers and slices
// from the lengths a value declares (vmihailenco/msgpack reserves a bin32's
// whole declared size at once), so 9 bytes can ask for 4 GiB. Check walks the
// value without allocating and refuses it unless every declared length and
// count fits in the bytes that follow; a decoder run on a value that passed
// allocates at most in proportion to its input.
package mpbound

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrOverrun is wrapped by the errors of Check.
var ErrOverrun = errors.New("mpbound: msgpack value declares more than the input holds")

// Check validates the first msgpack value of b (trailing bytes are not
// examined). It is iterative, so deep nesting cannot exhaust the stack: it
// counts the values still to read, each of which takes at least one byte.
func Check(b []byte) error {
	off, pending := 0, 1
	for pending > 0 {
		pending--
		if off >= len(b) {
			return fmt.Errorf("%w: value missing at byte %d", ErrOverrun, off)
		}
		c := b[off]
		off++
		var size, count uint64 // bytes to skip, values to add
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		case c&0xf0 == 0x80:
			count = 2 * uint64(c&0x0f)
		case c&0xf0 == 0x90:
			count = uint64(c & 0x0f)
		case c&0xe0 == 0xa0:
			size = uint64(c & 0x1f)
		default:
			var err error
			if size, count, off, err = header(b, off, c); err != nil {
				return err
			}
		}
		left := uint64(len(b) - off)
		if size > left {
			return fmt.Errorf("%w: %d bytes declared at byte %d, %d left", ErrOverrun, size, off, left)
		}
		off += int(size)
		// Every value still to read takes at least a byte.
		if int64(count) > int64(len(b)-off)-int64(pending) {
			return fmt.Errorf("%w: %d values declared at byte %d, %d bytes left", ErrOverrun, count, off, len(b)-off)
		}
		pending += int(count)
	}
	return nil
}

// header decodes the variable part of the value whose type byte c was just
// read: the bytes it covers or the values it contains, and where it ends.
func header(b []byte, off int, c byte) (size, count uint64, next int, err error) {
	n, fixed := 0, uint64(0) // length bytes, and bytes that follow unconditionally
	isCount, mult := false, uint64(1)
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		n = 1
	case 0xc5, 0xda: // bin16, str16
		n = 2
	case 0xc6, 0xdb: // bin32, str32
		n = 4
	case 0xc7, 0xc8, 0xc9: // ext8/16/32: length, then a type byte
		n, fixed = 1<<(c-0xc7), 1
	case 0xca, 0xd2, 0xce: // float32, int32, uint32
		fixed = 4
	case 0xcb, 0xd3, 0xcf: // float64, int64, uint64
		fixed = 8
	case 0xcc, 0xd0: // uint8, int8
		fixed = 1
	case 0xcd, 0xd1: // uint16, int16
		fixed = 2
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1..16, after a type byte
		fixed = 1 + 1<<(c-0xd4)
	case 0xdc, 0xdd: // array16, array32
		n, isCount = 2<<(c-0xdc), true
	case 0xde, 0xdf: // map16, map32
		n, isCount, mult = 2<<(c-0xde), true, 2
	default: // 0xc1, never used
		return 0, 0, off, fmt.Errorf("%w: invalid type byte %#x at byte %d", ErrOverrun, c, off-1)
	}
	if len(b)-off < n {
		return 0, 0, off, fmt.Errorf("%w: length of type %#x cut at byte %d", ErrOverrun, c, off)
	}
	var l uint64
	switch n {
	case 1:
		l = uint64(b[off])
	case 2:
		l = uint64(binary.BigEndian.Uint16(b[off:]))
	case 4:
		l = uint64(binary.BigEndian.Uint32(b[off:]))
	}
	off += n
	if isCount {
		return 0, l * mult, off, nil
	}
	return l + fixed, 0, off, nil
}
