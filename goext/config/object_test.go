package config

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func objectEnv(extra map[string]string) map[string]string {
	env := map[string]string{
		EnvCPUCacheGB:              "1",
		EnvObjectEnabled:           "1",
		EnvObjectBucket:            "kv-{worker_id}",
		EnvObjectEndpoint:          "http://127.0.0.1:9000",
		EnvObjectAccessKey:         "ak",
		EnvObjectSecretKey:         "sk",
		EnvObjectNumBlocks:         "",
		EnvObjectRegion:            "",
		EnvObjectWriteThrough:      "",
		EnvObjectLookupTimeoutSecs: "",
	}
	for k, v := range extra {
		env[k] = v
	}
	return env
}

func TestObjectDefaultsAndSubstitution(t *testing.T) {
	c, err := load(t, objectEnv(nil))
	require.NoError(t, err)
	o := c.Object
	require.True(t, o.Enabled)
	require.Equal(t, "kv-7", o.BucketFor(7))
	require.Equal(t, "http://127.0.0.1:9000", o.Endpoint)
	require.Equal(t, "127.0.0.1:9000", o.Host)
	require.False(t, o.Secure)
	require.Equal(t, DefaultObjectRegion, o.Region)
	require.True(t, o.WriteThrough)
	require.Equal(t, DefaultObjectNumBlocks, o.NumBlocks)
	require.Equal(t, DefaultObjectLookupTimeout, o.LookupTimeout)
	require.NoError(t, c.CheckObject())
	require.Contains(t, c.Summary(), "object (G4) tier: bucket kv-{worker_id}")
	require.Contains(t, c.Summary(), "look-ups time out after 2s")

	c, err = load(t, objectEnv(map[string]string{EnvObjectLookupTimeoutSecs: "30"}))
	require.NoError(t, err)
	require.Equal(t, 30*time.Second, c.Object.LookupTimeout)

	off, err := load(t, nil)
	require.NoError(t, err)
	require.False(t, off.Object.Enabled)
}

func TestObjectCredentialsFallBackToAWS(t *testing.T) {
	c, err := load(t, objectEnv(map[string]string{EnvObjectAccessKey: "", EnvObjectSecretKey: "",
		EnvAWSAccessKeyID: "aws-ak", EnvAWSSecretAccessKey: "aws-sk"}))
	require.NoError(t, err)
	require.Equal(t, "aws-ak", c.Object.AccessKey)
	require.Equal(t, "aws-sk", c.Object.SecretKey)

	// The object variables win over the AWS ones.
	c, err = load(t, objectEnv(map[string]string{EnvAWSAccessKeyID: "aws-ak", EnvAWSSecretAccessKey: "aws-sk"}))
	require.NoError(t, err)
	require.Equal(t, "ak", c.Object.AccessKey)
}

func TestObjectErrorsNameTheVariable(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		name string
	}{
		{map[string]string{EnvObjectBucket: ""}, EnvObjectBucket},
		{map[string]string{EnvObjectBucket: "Bad_Bucket"}, EnvObjectBucket},
		{map[string]string{EnvObjectEndpoint: "ftp://x"}, EnvObjectEndpoint},
		{map[string]string{EnvObjectEndpoint: "http://host:9000/path"}, EnvObjectEndpoint},
		{map[string]string{EnvObjectEndpoint: "http://host:99999"}, EnvObjectEndpoint},
		{map[string]string{EnvObjectSecretKey: ""}, EnvObjectSecretKey},
		{map[string]string{EnvObjectNumBlocks: "0"}, EnvObjectNumBlocks},
		{map[string]string{EnvObjectWriteThrough: "maybe"}, EnvObjectWriteThrough},
		{map[string]string{EnvObjectLookupTimeoutSecs: "0"}, EnvObjectLookupTimeoutSecs},
		{map[string]string{EnvObjectLookupTimeoutSecs: "1.5"}, EnvObjectLookupTimeoutSecs},
		{map[string]string{EnvObjectEnabled: "sometimes"}, EnvObjectEnabled},
	} {
		_, err := load(t, objectEnv(tc.env))
		var ve *VarError
		require.True(t, errors.As(err, &ve), "%v: %v", tc.env, err)
		require.Equal(t, tc.name, ve.Name, "%v: %v", tc.env, err)
	}
	// Malformed values are errors even while the tier is off.
	_, err := load(t, map[string]string{EnvObjectNumBlocks: "lots"})
	require.ErrorContains(t, err, EnvObjectNumBlocks)
}

func TestObjectNeedsHostTier(t *testing.T) {
	c, err := load(t, objectEnv(map[string]string{EnvCPUCacheGB: "", EnvDiskCacheOverrideBlocks: "10"}))
	require.NoError(t, err)
	err = c.CheckObject()
	var ve *VarError
	require.True(t, errors.As(err, &ve))
	require.Equal(t, EnvObjectEnabled, ve.Name)
	require.Contains(t, err.Error(), EnvCPUCacheGB)
}
