package zmqguard

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// However a stream is cut into reads, a connection's gate reaches the same
// verdict at the same byte, and never counts more than its limit for a peer
// it has not dropped.
func FuzzGate(f *testing.F) {
	f.Add(append(header(0, 2), "ok"...), uint8(1))
	f.Add(append(append(header(flagMore, 1), 'x'), append(header(0, 2), "ok"...)...), uint8(2))
	f.Add(header(0, 1<<40), uint8(3))
	f.Add(append(append(header(flagCommand, 4), "PING"...), header(0, 200)...), uint8(5))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		newGate := func() *Gate {
			return &Gate{Limit: 100, Verify: func(frames [][]byte) bool {
				return len(frames) == 1 && string(frames[0]) == "ok"
			}}
		}
		// at: stream bytes consumed when the verdict came (len(stream): none).
		run := func(step int) (authenticated bool, failed bool, at int, g *Gate) {
			g = newGate()
			s := newConnGate(g, "", 0)
			for off := 0; off < len(stream); {
				n := min(step, len(stream)-off)
				ok, err := s.scan(stream[off : off+n])
				off += n
				if err != nil || ok {
					return ok, err != nil, off, g
				}
				require.LessOrEqual(t, s.sent, uint64(g.Limit))
			}
			return false, false, len(stream), g
		}
		okWhole, failWhole, _, gw := run(len(stream) + 1)
		okByte, _, atByte, _ := run(1)
		step := int(cut%16) + 1
		okParts, failParts, at, gp := run(step)
		require.Equal(t, okWhole, okParts, "cut every %d bytes", step)
		require.Equal(t, failWhole, failParts, "cut every %d bytes", step)
		require.Equal(t, okWhole, okByte)
		if okParts || failParts {
			// The verdict comes in the read holding the byte that decides it.
			require.Equal(t, min((atByte+step-1)/step*step, len(stream)), at, "cut every %d bytes", step)
		}
		require.LessOrEqual(t, gw.Stats().MaxUnauthenticatedBytes, uint64(100))
		require.LessOrEqual(t, gp.Stats().MaxUnauthenticatedBytes, uint64(100))
	})
}
