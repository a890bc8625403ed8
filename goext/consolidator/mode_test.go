package consolidator

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
)

// TestModes feeds the same real engine events (ZMQ) and kvbm tier events
// to a consolidator in each mode and decodes what it publishes. dedup
// merges them; passthrough forwards the engine's events one per block, as
// they arrive, including what dedup absorbs, and none of kvbm's.
func TestModes(t *testing.T) {
	stored := func(h, parent uint64, hasParent bool, tok []uint32) events.EngineEvent {
		return events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{h}, ParentHash: parent,
			HasParent: hasParent, TokenIDs: tok, BlockSize: 4}
	}
	removed := func(h uint64) events.EngineEvent {
		return events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{h}}
	}
	for _, tc := range []struct {
		mode         Mode
		want         []events.EngineEvent
		deduplicated uint64
		notForwarded uint64
		tracked      int
	}{
		{mode: "", // the default
			want: []events.EngineEvent{
				stored(10, 0, false, tokA), stored(11, 10, true, tokB),
				removed(11), // kvbm evicted the last copy of tokA+tokB
				stored(50, 0, false, tokC),
			},
			deduplicated: 5, tracked: 2}, // kvbm's two stores, the repeat, the two removes,
		{mode: ModePassthrough,
			want: []events.EngineEvent{
				stored(10, 0, false, tokA), stored(11, 10, true, tokB),
				stored(10, 0, false, tokA), // the engine's repeated store
				removed(10), removed(11),   // although kvbm still holds both
				{Kind: events.KindCleared},
				stored(50, 0, false, tokC),
			},
			notForwarded: 3},
	} {
		t.Run(fmt.Sprintf("mode %q", tc.mode), func(t *testing.T) {
			pub, ep := enginePub(t, "tcp://127.0.0.1:0")
			rec := &logRecorder{}
			c, err := New(Config{Mode: tc.mode, EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0",
				Logger: slog.New(rec)})
			require.NoError(t, err)
			defer c.Close()
			dumpOnFail(t, c, rec)
			out := startSub(t, c.ZMQEndpoint())
			waitSubscribed(t, pub)
			waitSubscribed(t, c.pub)
			in := uint64(0)
			engine := func(evs ...any) {
				t.Helper()
				require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte{}, mustPack(t, []any{1.0, evs, 0}))))
				for _, ev := range evs {
					if n := len(ev.([]any)); n > 1 {
						in += uint64(len(ev.([]any)[1].([]any)))
					} else {
						in++
					}
				}
				waitIn(t, c, in)
			}
			kvbm := func(ev events.BlockEvent) {
				t.Helper()
				c.Publish(ev)
				in++
				waitIn(t, c, in)
			}

			engine([]any{"BlockStored", u64s(10, 11), nil, anyTokens(tokA, tokB), 4})
			kvbm(events.BlockEvent{Holder: host, SeqHash: 90, Tokens: tokA, BlockSize: 4})
			kvbm(events.BlockEvent{Holder: host, SeqHash: 91, Parent: 90, HasParent: true, Tokens: tokB, BlockSize: 4})
			engine([]any{"BlockStored", u64s(10), nil, anyTokens(tokA), 4})
			engine([]any{"BlockRemoved", u64s(10, 11)})
			engine([]any{"AllBlocksCleared"})
			kvbm(events.BlockEvent{Removed: true, Holder: host, SeqHash: 91})
			// Last: every mode publishes it, so anything published after
			// the events above would come before it and be seen.
			engine([]any{"BlockStored", u64s(50), nil, anyTokens(tokC), 4})

			var seq uint64
			require.Equal(t, tc.want, collect(t, out, len(tc.want), &seq))
			st := c.Stats()
			require.Equal(t, tc.deduplicated, st.Deduplicated)
			require.Equal(t, tc.notForwarded, st.NotForwarded)
			require.Equal(t, tc.tracked, st.Tracked)
			require.Equal(t, uint64(len(tc.want)), st.ZMQEvents)
			wantMode := tc.mode
			if wantMode == "" {
				wantMode = ModeDedup
			}
			require.NotEmpty(t, rec.grep(fmt.Sprintf("Starting KV Event Consolidator (mode %s)", wantMode)))
		})
	}
}

func TestModeValidation(t *testing.T) {
	c, err := New(Config{Mode: "dedupe", ZMQBind: "tcp://127.0.0.1:0"})
	require.Nil(t, c)
	require.ErrorContains(t, err, `mode "dedupe" (DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE): must be dedup or passthrough`)
}
