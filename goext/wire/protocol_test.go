package wire

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFrameGolden pins the wire format the package comment documents.
func TestFrameGolden(t *testing.T) {
	require.Equal(t, [][]byte{{0, 0, 0, 0, 0, 0, 1, 2}, []byte("step"), []byte("plan")},
		encodeLeader(0x102, fnStep, []byte("plan")))
	require.Equal(t, [][]byte{{0, 0, 0, 0, 0, 0, 0, 7}, []byte("ping")}, encodeLeader(7, fnPing, nil))
	require.Equal(t, [][]byte{{0, 0, 0, 0, 0, 0, 0, 9}, []byte("ack"), {0, 0, 0, 3}},
		encodeWorker(9, fnAck, 3, nil))
	require.Equal(t, [][]byte{{0, 0, 0, 0, 0, 0, 0, 9}, []byte("ack"), {0, 0, 1, 0}, []byte("boom")},
		encodeWorker(9, fnAck, 256, []byte("boom")))
}

func TestFrameRoundTrip(t *testing.T) {
	lm, err := decodeLeader(encodeLeader(42, fnLeaderMetadata, marshal(LeaderMetadata{NumHostBlocks: 5, NumDiskBlocks: 6, WorldSize: 2})))
	require.NoError(t, err)
	require.Equal(t, uint64(42), lm.id)
	require.Equal(t, fnLeaderMetadata, lm.fn)
	var md LeaderMetadata
	require.NoError(t, unmarshal(lm.payload, &md))
	require.Equal(t, LeaderMetadata{NumHostBlocks: 5, NumDiskBlocks: 6, WorldSize: 2}, md)

	want := WorkerMetadata{Rank: 3, WorldSize: 4, NumDeviceBlocks: 100, BytesPerBlock: 1 << 20, Pid: 77, Instance: 99}
	wm, err := decodeWorker(encodeWorker(0, fnWorkerMetadata, 3, marshal(want)))
	require.NoError(t, err)
	require.Equal(t, 3, wm.rank)
	var got WorkerMetadata
	require.NoError(t, unmarshal(wm.payload, &got))
	require.Equal(t, want, got)
}

func TestFrameMalformed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		frames [][]byte
		leader bool
	}{
		{"leader empty", nil, true},
		{"leader one frame", [][]byte{make([]byte, 8)}, true},
		{"leader short id", [][]byte{{1, 2}, []byte("ping")}, true},
		{"leader too many frames", [][]byte{make([]byte, 8), []byte("step"), {1}, {2}}, true},
		{"worker no rank", [][]byte{make([]byte, 8), []byte("ack")}, false},
		{"worker short rank", [][]byte{make([]byte, 8), []byte("ack"), {1}}, false},
		{"worker too many frames", [][]byte{make([]byte, 8), []byte("ack"), make([]byte, 4), {1}, {2}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			if tc.leader {
				_, err = decodeLeader(tc.frames)
			} else {
				_, err = decodeWorker(tc.frames)
			}
			require.ErrorIs(t, err, errFrame)
		})
	}
	var md WorkerMetadata
	require.ErrorIs(t, unmarshal([]byte{0xc1}, &md), errFrame)
}

func FuzzDecodeWorker(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 1}, []byte("ack"), []byte{0, 0, 0, 1}, []byte("x"))
	f.Fuzz(func(t *testing.T, a, b, c, d []byte) {
		m, err := decodeWorker([][]byte{a, b, c, d})
		if err == nil && m.fn == fnWorkerMetadata {
			var md WorkerMetadata
			_ = unmarshal(m.payload, &md)
		}
	})
}
