package worker

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
)

// An engine calling WaitLoads on one thread while the
// next step's StartLoad ran on another hit "WaitGroup is reused before
// previous Wait has returned" (a panic that poisoned the library).
func TestWaitLoadsConcurrentWithStartLoad(t *testing.T) {
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, Options{HostBlocks: nBlocks})
	// Something to load: G1 blocks 0..3 saved into G2 first.
	src := []int64{0, 1, 2, 3}
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, src, plan.G2, src)})

	stop := make(chan struct{})
	var waiters sync.WaitGroup
	for range 8 {
		waiters.Add(1)
		go func() {
			defer waiters.Done()
			for {
				select {
				case <-stop:
					return
				default:
					w.WaitLoads()
				}
			}
		}()
	}
	for seq := uint64(2); seq < 1002; seq++ {
		dst := []int64{10 + int64(seq%4)}
		step := &plan.Step{Seq: seq, Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G2, src[:1], plan.G1, dst)}}}
		require.NoError(t, w.Bind(step))
		w.StartLoad()
		w.WaitForSave()
	}
	close(stop)
	waiters.Wait()
	w.WaitLoads()
	loaded, failed := w.Finished()
	require.Len(t, loaded, 1000)
	require.Empty(t, failed)
}
