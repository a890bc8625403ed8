package wire

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// Side-channel payloads: anyone who reaches the side
// channel can send worker metadata whose pid_ns declares a 4 GiB string;
// msgpack reserved memory for it before finding the payload short.
func TestUnmarshalRefusesLengthsBeyondPayload(t *testing.T) {
	forged := []byte{0x81, 0xa6, 'p', 'i', 'd', '_', 'n', 's', 0xdb, 0xff, 0xff, 0xff, 0xf0, 'x'}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var md WorkerMetadata
	err := unmarshal(forged, &md)
	runtime.ReadMemStats(&after)
	require.ErrorIs(t, err, errFrame)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<10))
}
