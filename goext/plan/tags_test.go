package plan

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTagsRoundTrip(t *testing.T) {
	s := &Step{Seq: 9, Moves: []Copy{{Src: G2, SrcBlock: 1, Dst: G3, DstBlock: 4}}, Tags: []BlockTag{
		{Block: 4, SeqHash: 1<<63 + 5, Parent: 77, HasParent: true, Priority: -3, Tokens: []uint32{1, 2, 1 << 31}},
		{Block: 5, SeqHash: 6},
	}}
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s, got)

	// A step without tags encodes as before.
	s.Tags = nil
	b, err = s.Encode()
	require.NoError(t, err)
	got, err = Decode(b)
	require.NoError(t, err)
	require.Nil(t, got.Tags)
}

func TestTagsMalformed(t *testing.T) {
	good := AppendTags(nil, []BlockTag{{Block: 1, Tokens: []uint32{1, 2}}})
	for _, b := range [][]byte{good[:tagFixed-1], good[:len(good)-1]} {
		_, err := ParseTags(b)
		require.Error(t, err)
	}
	ts, err := ParseTags(good)
	require.NoError(t, err)
	require.Equal(t, []uint32{1, 2}, ts[0].Tokens)
}

func TestHostTagsAndRefsRoundTrip(t *testing.T) {
	s := &Step{Seq: 3,
		Saves: []Copy{{Src: G1, SrcBlock: 1, Dst: G2, DstBlock: 4}},
		HostTags: []HostTag{
			{ID: 7, BlockTag: BlockTag{Block: 4, SeqHash: 9, Parent: 8, HasParent: true, Priority: 2, Tokens: []uint32{5, 6}}},
			{ID: 1 << 60, BlockTag: BlockTag{Block: 5, SeqHash: 10}},
		},
		TagRefs: []TagRef{{Block: 3, ID: 7}, {Block: 1 << 40, ID: 1<<64 - 1}},
	}
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s, got)

	for _, bad := range []*Step{{HostTags: s.HostTags[:1]}, {TagRefs: s.TagRefs}} {
		b, err := bad.Encode()
		require.NoError(t, err)
		_, err = Decode(b[:len(b)-1])
		require.Error(t, err, "a truncated list is an error")
	}
}

func TestHostTagsAndRefsMalformed(t *testing.T) {
	good := appendHostTags(nil, []HostTag{{ID: 1, BlockTag: BlockTag{Block: 1, Tokens: []uint32{1, 2}}}})
	for _, b := range [][]byte{good[:7], good[:8+tagFixed-1], good[:len(good)-1]} {
		_, err := parseHostTags(b)
		require.Error(t, err)
	}
	_, err := parseTagRefs(make([]byte, tagRefBytes+1))
	require.Error(t, err)
}
