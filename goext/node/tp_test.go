package node

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/internal/testports"
	"github.com/kvbm/kvbm/goext/leader"
)

// TestTensorParallelThroughNode: a leader and two ranks of one process,
// assembled through the front door and joined by the in-process side
// channel: the handshake sizes the leader from what the ranks report, and
// a step's plan binds on both.
func TestTensorParallelThroughNode(t *testing.T) {
	ports := testports.Free(t, 2)
	cfg := testConfig(t, map[string]string{
		config.EnvCPUCacheOverrideBlocks: "16",
		config.EnvLeaderZMQPubPort:       fmt.Sprint(ports[0]),
		config.EnvLeaderZMQAckPort:       fmt.Sprint(ports[1]),
	})
	d := Deps{Registry: NewRegistry(), Logger: quiet()}
	co, err := ListenSideChannel(cfg, LeaderSideChannel{Transport: "inproc", Secret: "s"}, 2, d)
	require.NoError(t, err)
	defer func() { _ = co.Close() }()
	var ws []*Worker
	for rank := range 2 {
		w, err := NewWorker(cfg, WorkerSpec{Layout: cpuSpec(t, 1), Rank: rank, NumWorkers: 2,
			SideChannel: &WorkerSideChannel{Transport: "inproc", Secret: "s"}}, d)
		require.NoError(t, err)
		defer w.Close()
		ws = append(ws, w)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hs, err := co.Handshake(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, hs.NumWorkers)
	require.Equal(t, ws[0].Layout.BytesPerBlock(), hs.BytesPerBlock)
	require.Equal(t, ws[0].HostBlocks, hs.NumHostBlocks)

	l, err := NewLeader(cfg, LeaderSpec{BlockSize: bs, BytesPerBlock: hs.BytesPerBlock, NumWorkers: hs.NumWorkers,
		SideChannel: co}, d)
	require.NoError(t, err)
	defer l.Close()
	prompt := make([]uint32, 2*bs)
	l.L.UpdateStateAfterAlloc("a", []int64{0, 1}, 0)
	b, err := l.L.Step([]leader.RequestUpdate{{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{0, 1},
		NumScheduledTokens: len(prompt)}})
	require.NoError(t, err)
	for _, w := range ws {
		require.NoError(t, w.W.BindStep(b))
		w.W.StartLoad()
		w.W.WaitForSave()
	}
	used, _ := l.L.BlocksUsed()
	require.Equal(t, 2, used, "the step's two full blocks are stored in G2")
	for _, w := range ws {
		select {
		case <-w.Member.Ready():
		case <-ctx.Done():
			t.Fatal("a rank never saw the handshake complete")
		}
	}
}
