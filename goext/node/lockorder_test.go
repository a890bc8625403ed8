package node

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/internal/testports"
	"github.com/kvbm/kvbm/goext/leader"
)

// TestLockOrder exercises the package comment's lock order under -race: a
// leader's steps publish into its consolidator and tier event buffer under
// the leader's lock while other goroutines match, read the consolidator's
// stats and drain the buffer. A lock taken in the reverse order anywhere
// deadlocks here (the test times out); a shared field read without its lock
// is reported by the race detector.
func TestLockOrder(t *testing.T) {
	cfg := testConfig(t, map[string]string{config.EnvCPUCacheOverrideBlocks: "8"})
	l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, TierEvents: true,
		Consolidator: &ConsolidatorSpec{ZMQBind: fmt.Sprintf("tcp://127.0.0.1:%d", testports.Free(t, 1)[0])}},
		Deps{Registry: NewRegistry(), Logger: quiet()})
	require.NoError(t, err)
	defer l.Close()

	const rounds = 200
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(3)
	go func() { // the engine's scheduler: steps that store and evict (8 blocks, 2 per request)
		defer wg.Done()
		defer close(stop)
		for i := range rounds {
			id := fmt.Sprint("r", i)
			prompt := make([]uint32, 2*bs)
			for k := range prompt {
				prompt[k] = uint32(i*100 + k)
			}
			l.L.GetNumNewMatchedTokens(id, prompt, 0, 0)
			l.L.UpdateStateAfterAlloc(id, []int64{0, 1}, 0)
			_, err := l.L.Step([]leader.RequestUpdate{{ReqID: id, NewTokens: prompt, NewBlockIDs: []int64{0, 1},
				NumScheduledTokens: len(prompt)}})
			if err != nil {
				t.Error(err)
				return
			}
			l.L.RequestFinished(id)
		}
	}()
	drained := 0
	go func() { // the adapter publishing tier events
		defer wg.Done()
		for {
			select {
			case <-stop:
				drained += len(l.TierEvents.Drain())
				return
			default:
				drained += len(l.TierEvents.Drain())
			}
		}
	}()
	go func() { // kvbm_leader_info
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
				_ = l.Consolidator.Stats()
				l.L.HitRates()
				l.L.BlocksUsed()
			}
		}
	}()
	wg.Wait()
	st := l.Consolidator.Stats()
	// Both sinks saw every event: each request's two stores, and the
	// removals of the blocks the 8-block tier evicted.
	require.Equal(t, st.EventsIn, uint64(drained))
	require.GreaterOrEqual(t, st.EventsIn, uint64(2*rounds))
}
