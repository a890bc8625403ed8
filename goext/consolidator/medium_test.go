package consolidator

import (
	"log/slog"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
)

// TestOtherTiersInTheEngineStreamAreSkipped: the engine's stream may carry
// kvbm's G2/G3 events (medium CPU / STORAGE, under the engine's hashes);
// the consolidator takes only the engine's G1 from it.
func TestOtherTiersInTheEngineStreamAreSkipped(t *testing.T) {
	pub, ep := enginePub(t, "tcp://127.0.0.1:0")
	rec := &logRecorder{}
	c, err := New(Config{EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0", Logger: slog.New(rec)})
	require.NoError(t, err)
	defer c.Close()
	dumpOnFail(t, c, rec)
	out := startSub(t, c.ZMQEndpoint())
	waitSubscribed(t, pub)
	waitSubscribed(t, c.pub)
	send := func(n uint64, evs ...any) {
		t.Helper()
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte{}, mustPack(t, []any{1.0, evs, 0}))))
		waitIn(t, c, n)
	}
	send(3,
		[]any{"BlockStored", u64s(20, 21), nil, anyTokens(tokA, tokB), 4, nil, "CPU"},
		[]any{"BlockStored", u64s(22), nil, anyTokens(tokC), 4, nil, "STORAGE"})
	send(4, []any{"BlockRemoved", u64s(20), "CPU"})
	send(5, []any{"BlockStored", u64s(10), nil, anyTokens(tokA), 4, nil, "GPU"})

	var seq uint64
	want := []events.EngineEvent{{Kind: events.KindStored, BlockHashes: []uint64{10}, TokenIDs: tokA, BlockSize: 4}}
	require.Equal(t, want, collect(t, out, 1, &seq))
	st := c.Stats()
	require.Equal(t, uint64(4), st.NotForwarded)
	require.Equal(t, 1, st.Tracked)
	require.Zero(t, st.UnknownRemoves)
}
