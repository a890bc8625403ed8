package config

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLoadPolicyAndAdmission(t *testing.T) {
	c, err := load(t, map[string]string{
		EnvLoadPolicy: " never-slower-than=12.5 ", EnvPrefillUsPerToken: "80",
		EnvDiskAdmission: "sketch", EnvObjectAdmission: "sketch",
		EnvDiskWriteMBps: "250", EnvObjectPutsPerSec: "0",
	})
	require.NoError(t, err)
	require.Equal(t, LoadPolicy{Mode: LoadCap, CapMs: 12.5, PrefillUsPerToken: 80}, c.LoadPolicy)
	require.Equal(t, Admission{Disk: AdmitSketch, Object: AdmitSketch, DiskWriteMBps: 250}, c.Admission)

	c, err = load(t, map[string]string{EnvLoadPolicy: "cost"})
	require.NoError(t, err)
	require.Equal(t, LoadCost, c.LoadPolicy.Mode)

	// The old switch means "offload every block".
	c, err = load(t, map[string]string{EnvDisableDiskOffloadFilter: "1"})
	require.NoError(t, err)
	require.Equal(t, AdmitAll, c.Admission.Disk)
}

func TestLoadPolicyAndAdmissionErrors(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		name string
		want string
	}{
		{map[string]string{EnvLoadPolicy: "fast"}, EnvLoadPolicy, "must be one of always, cost"},
		{map[string]string{EnvLoadPolicy: "never-slower-than="}, EnvLoadPolicy, "milliseconds"},
		{map[string]string{EnvLoadPolicy: "never-slower-than=-5"}, EnvLoadPolicy, "milliseconds"},
		{map[string]string{EnvLoadPolicy: "never-slower-than=NaN"}, EnvLoadPolicy, "milliseconds"},
		{map[string]string{EnvPrefillUsPerToken: "0"}, EnvPrefillUsPerToken, "must be positive"},
		{map[string]string{EnvPrefillUsPerToken: "-3"}, EnvPrefillUsPerToken, "must not be negative"},
		{map[string]string{EnvPrefillUsPerToken: "abc"}, EnvPrefillUsPerToken, "not a number"},
		{map[string]string{EnvDiskAdmission: "lfu"}, EnvDiskAdmission, "must be one of frequency, sketch, all"},
		{map[string]string{EnvObjectAdmission: "frequency"}, EnvObjectAdmission, "must be one of all, sketch"},
		{map[string]string{EnvDiskWriteMBps: "-1"}, EnvDiskWriteMBps, "must not be negative"},
		{map[string]string{EnvObjectPutsPerSec: "-0.5"}, EnvObjectPutsPerSec, "must not be negative"},
		{map[string]string{EnvObjectPutsPerSec: "Inf"}, EnvObjectPutsPerSec, "finite"},
		{map[string]string{EnvDisableDiskOffloadFilter: "1", EnvDiskAdmission: "sketch"}, EnvDiskAdmission,
			EnvDisableDiskOffloadFilter},
	} {
		_, err := load(t, tc.env)
		require.Error(t, err, tc.env)
		var ve *VarError
		require.True(t, errors.As(err, &ve), err)
		require.Equal(t, tc.name, ve.Name, err)
		require.ErrorContains(t, err, tc.want)
	}
}
