package plan

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSaltsRoundTrip: G4Salts travel with the step; SaltOf answers 0 (the
// default salt) for hashes not listed; a torn list is an error.
func TestSaltsRoundTrip(t *testing.T) {
	s := &Step{Seq: 3, Uploads: []Upload{{Block: 1, Hash: 10}, {Block: 2, Hash: 11, Parent: 10}},
		G4Salts: []SaltRef{{Hash: 10, Salt: 77}, {Hash: 11, Salt: 77}}}
	b, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, s, got)
	of := got.SaltOf()
	require.Equal(t, uint64(77), of(11))
	require.Zero(t, of(12))
	require.Zero(t, (&Step{}).SaltOf()(10))
	_, err = parseSaltRefs(make([]byte, 15))
	require.ErrorContains(t, err, "not a multiple of 16")
}
