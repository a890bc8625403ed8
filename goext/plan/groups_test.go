package plan

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGroupRowsRoundTrip(t *testing.T) {
	s := &Step{Seq: 3, Saves: []Copy{{G1, 4, G2, 1}},
		G1Groups: &GroupRows{Groups: 2, Rows: [][]int64{{4, 4, 9}, {5, 5, -1}}}}
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s.G1Groups, got.G1Groups)
	require.Equal(t, map[int64][]int64{4: {4, 9}, 5: {5, -1}}, got.G1Groups.Map())

	// A step without groups encodes as before and decodes without rows.
	b, err = (&Step{Seq: 3}).Encode()
	require.NoError(t, err)
	got, err = Decode(b)
	require.NoError(t, err)
	require.Nil(t, got.G1Groups)
	require.Nil(t, got.G1Groups.Map())
}

func TestGroupRowsMalformed(t *testing.T) {
	le := func(vs ...uint64) []byte {
		var b []byte
		for _, v := range vs {
			b = binary.LittleEndian.AppendUint64(b, v)
		}
		return b
	}
	for name, b := range map[string][]byte{
		"empty":      nil,
		"zero width": le(0),
		"too wide":   le(1 << 20),
		"ragged":     le(2, 1, 2),
		"odd bytes":  append(le(1, 1, 2), 0),
	} {
		_, err := parseGroupRows(b)
		require.Error(t, err, name)
	}
}
