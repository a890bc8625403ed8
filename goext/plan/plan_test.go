package plan

import (
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
