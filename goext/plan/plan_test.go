package plan

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

func bigStep(n int) *Step {
	s := &Step{Seq: 42}
	ld := Load{ReqID: "req-1"}
	for i := 0; i < n; i++ {
		ld.Copies = append(ld.Copies, Copy{Src: G2, SrcBlock: int64(i * 3), Dst: G1, DstBlock: int64(8191 - i)})
		s.Saves = append(s.Saves, Copy{Src: G1, SrcBlock: int64(i), Dst: G2, DstBlock: int64(i + 7)})
	}
	s.Loads = []Load{ld}
	s.Moves = []Copy{{Src: G2, SrcBlock: 1, Dst: G3, DstBlock: 2}}
	s.Drops = []Copy{{Src: G3, SrcBlock: 5}}
	return s
}

func TestRoundTrip(t *testing.T) {
	s := bigStep(100)
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s, got)
	require.True(t, (&Step{Seq: 1}).Empty())
	require.False(t, got.Empty())
}

func TestDecodeGarbage(t *testing.T) {
	for _, b := range [][]byte{nil, {0xc1}, {0x81, 0xa1, 'l', 0x05}, []byte("not msgpack at all")} {
		_, err := Decode(b)
		require.Error(t, err, "%x", b)
	}
}

// 9 bytes declaring 2^32 loads, or a bin32 declaring
// 4 GiB of copies, made Decode reserve that much before failing.
func TestDecodeRefusesLengthsBeyondInput(t *testing.T) {
	for name, b := range map[string][]byte{
		"4G loads":       {0x81, 0xa1, 'l', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"4 GiB of saves": {0x81, 0xa1, 'v', 0xc6, 0xff, 0xff, 0xff, 0xff, 0},
		"4 GiB req id":   {0x81, 0xa1, 'l', 0x91, 0x81, 0xa1, 'r', 0xdb, 0xff, 0xff, 0xff, 0xff},
		"4 GiB skipped":  {0x81, 0xa1, 'z', 0xc6, 0xff, 0xff, 0xff, 0xff},
	} {
		before := allocatedBytes()
		_, err := Decode(b)
		require.Error(t, err, name)
		require.Less(t, allocatedBytes()-before, uint64(1<<20), name)
	}
}

func allocatedBytes() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.TotalAlloc
}

// An empty load list is no load list: Encode omits it.
func TestDecodeEmptyLoadsIsNil(t *testing.T) {
	for _, b := range [][]byte{
		{0x82, 0xa1, 'q', 1, 0xa1, 'l', 0xc0},
		{0x82, 0xa1, 'q', 1, 0xa1, 'l', 0x90},
	} {
		s, err := Decode(b)
		require.NoError(t, err)
		require.Nil(t, s.Loads)
		require.Equal(t, &Step{Seq: 1}, s)
	}
}

func BenchmarkDecode2048(b *testing.B) {
	enc, _ := bigStep(2048).Encode()
	b.SetBytes(int64(len(enc)))
	for i := 0; i < b.N; i++ {
		if _, err := Decode(enc); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncode2048(b *testing.B) {
	s := bigStep(2048)
	for i := 0; i < b.N; i++ {
		if _, err := s.Encode(); err != nil {
			b.Fatal(err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, n := range []int{0, 1, 3} {
		b, _ := bigStep(n).Encode()
		f.Add(b)
	}
	f.Add([]byte{0x81, 0xa1, 'v', 0xc4, 0x05, 1, 2, 3, 4, 5})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := Decode(b)
		if err != nil {
			return
		}
		// Whatever decodes must re-encode to something that decodes the same.
		again, err := s.Encode()
		require.NoError(t, err)
		s2, err := Decode(again)
		require.NoError(t, err)
		require.Equal(t, s, s2)
	})
}
