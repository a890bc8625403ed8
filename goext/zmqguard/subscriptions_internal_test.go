package zmqguard

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

func readyBody(props ...string) []byte {
	b := append([]byte{5}, "READY"...)
	for i := 0; i+1 < len(props); i += 2 {
		b = append(b, byte(len(props[i])))
		b = append(b, props[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(props[i+1])))
		b = append(b, props[i+1]...)
	}
	return b
}

// Every READY that zmq4 reads as a subscriber's is one for the guard (names
// compared without case; any Socket-Type property counts).
func TestPeerIsSubscriber(t *testing.T) {
	for _, tc := range []struct {
		ready []byte
		want  bool
	}{
		{readyBody("Socket-Type", "SUB"), true},
		{readyBody("Identity", "x", "socket-type", "XSUB"), true},
		{readyBody("Socket-Type", "PUSH", "Socket-Type", "SUB"), true},
		{readyBody("Socket-Type", "SUB", "Socket-Type", "PUSH"), true},
		{readyBody("Socket-Type", "PUSH"), false},
		{readyBody("Socket-Type", "sub"), false}, // zmq4 compares the type exactly
		{readyBody("Socket-Type", "SUB")[:12], false},
		{nil, false},
		{[]byte{200}, false},
	} {
		require.Equal(t, tc.want, peerIsSubscriber(tc.ready), "%q", tc.ready)
	}
}
