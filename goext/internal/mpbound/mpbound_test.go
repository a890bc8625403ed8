package mpbound

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func TestCheckAcceptsWellFormedValues(t *testing.T) {
	for _, v := range []any{
		nil, true, 1, -1, 300, -300, 1 << 40, 1.5, float32(2.5), "", "abc",
		string(make([]byte, 300)), make([]byte, 70000), []any{1, "x", []byte{1}},
		map[string]any{"a": []any{map[string]any{"b": nil}}, "c": uint64(1) << 63},
		make([]int, 20000), msgpack.RawMessage{0xd4, 1, 2}, msgpack.RawMessage{0xc7, 2, 1, 9, 9},
	} {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		require.NoError(t, Check(b), "%T %x", v, b)
	}
}

// Each of these declares more than it holds; msgpack decoders would
// allocate the declared size (up to 4 GiB) before finding out.
func TestCheckRejectsLengthsBeyondInput(t *testing.T) {
	for name, b := range map[string][]byte{
		"empty":              {},
		"bin32 4 GiB":        {0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2},
		"str32":              {0xdb, 0x7f, 0xff, 0xff, 0xff},
		"array32 of 4G":      {0xdd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3},
		"map32":              {0xdf, 0x00, 0x01, 0x00, 0x00, 1},
		"plan with 4G loads": {0x81, 0xa1, 'l', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"nested counts":      {0x92, 0x92, 0x92, 1},
		"cut length":         {0xc5, 0x01},
		"cut fixstr":         {0xa5, 'a'},
		"ext32":              {0xc9, 0xff, 0xff, 0xff, 0xff, 1},
		"never used":         {0xc1},
		"missing map value":  {0x81, 0xa1, 'q'},
	} {
		require.ErrorIs(t, Check(b), ErrOverrun, name)
	}
}

func FuzzCheck(f *testing.F) {
	f.Add([]byte{0x81, 0xa1, 'l', 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x92, 0xc4, 1, 0, 0xa1, 'x'})
	f.Fuzz(func(t *testing.T, b []byte) {
		if Check(b) != nil {
			return
		}
		// What passes decodes without the decoder running out of input
		// for a length it was promised.
		var v any
		if err := msgpack.Unmarshal(b, &v); err != nil {
			require.NotContains(t, err.Error(), "EOF", "%x", b)
		}
	})
}
