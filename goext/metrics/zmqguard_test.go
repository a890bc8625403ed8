package metrics

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestZMQGuardCountersExported(t *testing.T) {
	fams, err := New().Registry.Gather()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, f := range fams {
		names[f.GetName()] = true
	}
	for _, n := range []string{"kvbm_zmq_handshakes_refused", "kvbm_zmq_oversized_messages", "kvbm_zmq_slow_peers_dropped", "kvbm_zmq_subscribers_dropped"} {
		require.True(t, names[n], n)
	}
}
