package leader

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/internal/testports"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/wire"
)

// wireRank is one rank on the real side channel, recording what it ran.
type wireRank struct {
	m *wire.Member

	mu   sync.Mutex
	ran  []*plan.Step
	fail error // Execute returns it when set
}

func (r *wireRank) executed() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ran)
}

// wireCluster binds a coordinator for world ranks, connects them, runs the
// handshake and returns the coordinator and the ranks.
func wireCluster(t *testing.T, tr wire.Transport, world int) (*wire.Coordinator, []*wireRank) {
	t.Helper()
	ep := wire.Endpoint{Host: t.Name(), PubPort: 1, AckPort: 2}
	if tr == wire.TransportTCP {
		p := testports.Free(t, 2)
		ep = wire.Endpoint{Host: "127.0.0.1", PubPort: p[0], AckPort: p[1]}
	}
	logs := &lockedBuf{}
	logger := slogTo(logs)
	co, err := wire.Listen(wire.CoordinatorOptions{
		NumWorkers: world, Endpoint: ep, Transport: tr, Secret: "s", Logger: logger,
		Size:          func(int64, int) (int, int, error) { return 16, 16, nil },
		RetryInterval: 20 * time.Millisecond, PingInterval: 50 * time.Millisecond, SuspectAfter: time.Minute,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = co.Close()
		if t.Failed() {
			t.Log(logs.String())
		}
	})
	ranks := make([]*wireRank, world)
	for rank := range ranks {
		r := &wireRank{}
		ranks[rank] = r
		m, err := wire.Connect(wire.MemberOptions{
			Rank: rank, WorldSize: world, NumDeviceBlocks: 64, BytesPerBlock: 1 << 20, Endpoint: ep, Transport: tr,
			Secret: "s", Logger: logger, RetryInterval: 20 * time.Millisecond,
			Allocate: func(wire.LeaderMetadata) error { return nil },
			Execute: func(_ context.Context, step []byte) error {
				st, err := plan.Decode(step)
				if err != nil {
					return err
				}
				r.mu.Lock()
				defer r.mu.Unlock()
				r.ran = append(r.ran, st)
				return r.fail
			},
		})
		require.NoError(t, err)
		r.m = m
		t.Cleanup(func() { _ = m.Close() })
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hs, err := co.Handshake(ctx)
	require.NoError(t, err)
	require.Equal(t, world, hs.NumWorkers)
	return co, ranks
}

func TestSideChannelOverTheRealWire(t *testing.T) {
	for _, tr := range []wire.Transport{wire.TransportInProc, wire.TransportTCP} {
		t.Run(tr.String(), func(t *testing.T) {
			co, ranks := wireCluster(t, tr, 2)
			s := newScEnv(t, co, 0)
			s.saveA(t)
			waitFor(t, func() bool { return s.stats().Committed == 1 }, "both ranks acked")
			require.Equal(t, 2, diskUsed(s.l))
			for _, r := range ranks {
				require.Equal(t, 1, r.executed())
				require.Len(t, r.ran[0].Moves, 2)
			}

			// A rank whose execution fails: the operation fails naming it,
			// its blocks are not registered, its moves wait for a retry.
			ranks[1].mu.Lock()
			ranks[1].fail = errors.New("disk full")
			ranks[1].mu.Unlock()
			s.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(100, 8), NewBlockIDs: []int64{5, 6}, NumScheduledTokens: 8})
			waitFor(t, func() bool { return s.stats().Failed == 1 }, "failed")
			require.Contains(t, s.stats().LastError, "rank 1")
			require.Equal(t, 2, diskUsed(s.l))

			ranks[1].mu.Lock()
			ranks[1].fail = nil
			ranks[1].mu.Unlock()
			s.step(t)
			waitFor(t, func() bool { return s.stats().Committed == 2 }, "retried")
			require.Equal(t, 4, diskUsed(s.l))

			// Rank 1 leaves: the leader degrades at the next step.
			require.NoError(t, ranks[1].m.Close())
			waitFor(t, func() bool { return len(co.DeadRanks()) > 0 }, "rank 1 seen gone")
			s.step(t)
			waitFor(t, func() bool { d, _ := s.l.Degraded(); return d }, "degraded")
			_, dead := s.l.Degraded()
			require.Equal(t, []int{1}, dead)
		})
	}
}
