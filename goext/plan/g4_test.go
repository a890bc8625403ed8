package plan

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

func TestG4RoundTrip(t *testing.T) {
	// A G4 copy names its block by the full 64-bit sequence hash.
	h := uint64(math.MaxUint64 - 5)
	s := &Step{Seq: 3,
		Loads: []Load{{ReqID: "r", Copies: []Copy{
			{Src: G4, SrcBlock: int64(h), Dst: G2, DstBlock: 9},
			{Src: G2, SrcBlock: 9, Dst: G1, DstBlock: 4},
		}}},
		Uploads: []Upload{{Block: 1, Hash: h, Parent: 7}, {Block: 2, Hash: 8}},
	}
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s, got)
	require.Equal(t, h, uint64(got.Loads[0].Copies[0].SrcBlock))
	require.False(t, (&Step{Uploads: s.Uploads}).Empty())
	require.Equal(t, "G4", G4.String())

	_, err = Decode(must(msgpack.Marshal(map[string]any{"q": 1, "u": []byte{1, 2, 3}})))
	require.ErrorContains(t, err, "not a multiple of 24")
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
