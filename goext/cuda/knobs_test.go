package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestKnobValues: the copier's tuning variables are unset, a positive count
// of their unit, or an error that names the variable.
func TestKnobValues(t *testing.T) {
	for _, tc := range []struct {
		value string
		unit  int64
		want  int64
		bad   bool
	}{
		{"", 1 << 20, 0, false},
		{"  ", 1, 0, false},
		{"64", 1 << 20, 64 << 20, false},
		{" 3 ", 1, 3, false},
		{"0", 1, 0, true},
		{"-2", 1, 0, true},
		{"12MiB", 1 << 20, 0, true},
		{"1.5", 1, 0, true},
		{"9223372036854775807", 1 << 20, 0, true},
	} {
		got, err := knob("KVBM_CUDA_STAGING_MIB", tc.value, tc.unit)
		if tc.bad {
			require.ErrorContains(t, err, "KVBM_CUDA_STAGING_MIB=", tc.value)
			require.ErrorContains(t, err, "cuda: ", tc.value)
			continue
		}
		require.NoError(t, err, tc.value)
		require.Equal(t, tc.want, got, tc.value)
	}
}
