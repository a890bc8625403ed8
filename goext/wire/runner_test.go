package wire

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/transfer"
	"github.com/kvbm/kvbm/goext/worker"
)

// A rank whose side channel executes straight into a real worker.Worker:
// operations move real bytes G1→G2→G3→G1, a failed load fails the
// operation naming the rank, and mismatching tier sizes fail the handshake.
func TestRunOnWorker(t *testing.T) {
	g1, err := procG1(layout.CPUPaged, 0)
	require.NoError(t, err)
	w, err := worker.New(worker.Options{Rank: 0, HostBlocks: 10, DiskBlocks: 20, DiskDir: t.TempDir(), DisableODirect: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	require.NoError(t, w.RegisterG1(g1))

	c := newCluster(t, TransportInProc, 1)
	m, err := Connect(MemberOptions{
		Rank: 0, WorldSize: 1, NumDeviceBlocks: procBlocks, BytesPerBlock: g1.BytesPerBlock(), Endpoint: c.ep,
		Transport: c.tr, Logger: testLogger(c.logs), Allocate: ExpectSizes(10, 20), Execute: RunOn(w),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	l, err := Listen(CoordinatorOptions{NumWorkers: 1, Endpoint: c.ep, Transport: c.tr, Size: fixedSize, Logger: testLogger(c.logs)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	_, err = l.Handshake(ctxTimeout(t, 30*time.Second))
	require.NoError(t, err)

	run := func(st plan.Step) error {
		b, err := st.Encode()
		require.NoError(t, err)
		return l.Broadcast(ctxTimeout(t, 30*time.Second), b)
	}
	require.NoError(t, run(plan.Step{Saves: []plan.Copy{{Src: plan.G1, SrcBlock: 3, Dst: plan.G2, DstBlock: 0}}}))
	require.NoError(t, run(plan.Step{Moves: []plan.Copy{{Src: plan.G2, SrcBlock: 0, Dst: plan.G3, DstBlock: 1}}}))
	require.NoError(t, run(plan.Step{Loads: []plan.Load{{ReqID: "r", Copies: []plan.Copy{{Src: plan.G3, SrcBlock: 1, Dst: plan.G1, DstBlock: 7}}}}}))
	want, got := make([]byte, g1.BytesPerBlock()), make([]byte, g1.BytesPerBlock())
	transfer.Gather(g1, 3, want)
	transfer.Gather(g1, 7, got)
	require.True(t, bytes.Equal(want, got), "G1 block 7 holds block 3's bytes after G1→G2→G3→G1")

	err = run(plan.Step{Loads: []plan.Load{{ReqID: "s", Copies: []plan.Copy{{Src: plan.G2, SrcBlock: 9, Dst: plan.G1, DstBlock: 8}}}}})
	require.ErrorContains(t, err, "rank 0")
	require.ErrorContains(t, err, "loads into G1 blocks [8] failed")

	// A step this rank never saw: Run waits for it; Close ends the wait.
	b, err := (&plan.Step{Seq: 5}).Encode()
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- l.Broadcast(ctx, b) }()
	require.NoError(t, m.Close())
	select {
	case err := <-done:
		require.Error(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("closing the member did not end an operation waiting for its engine step")
	}
}

func TestExpectSizesNamesTheVariables(t *testing.T) {
	require.NoError(t, ExpectSizes(10, 20)(LeaderMetadata{NumHostBlocks: 10, NumDiskBlocks: 20}))
	err := ExpectSizes(10, 20)(LeaderMetadata{NumHostBlocks: 9, NumDiskBlocks: 20})
	require.ErrorContains(t, err, "sized 10 host and 20 disk blocks")
	require.ErrorContains(t, err, "DYN_KVBM_CPU_CACHE_*")
}
