package worker

import (
	"bytes"
	"errors"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
)

// syncBuffer is a log destination shared by the worker's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestNUMAPlacement: DYN_KVBM_ENABLE_NUMA places the host tier on the node
// of the registering CPU where the machine has several nodes, logs a no-op
// on one node, falls back to the default policy when the node cannot be
// told, and is not consulted when off. The tier works in every case.
func TestNUMAPlacement(t *testing.T) {
	for _, tc := range []struct {
		name     string
		numa     bool
		topology func() (int, int, error)
		wantNode int
		wantLog  string
	}{
		{name: "two nodes", numa: true, topology: func() (int, int, error) { return 0, 2, nil },
			wantNode: 0, wantLog: "numa_node=0"},
		{name: "one node", numa: true, topology: func() (int, int, error) { return 0, 1, nil },
			wantNode: -1, wantLog: "one NUMA node; placing the host tier on it is a no-op"},
		{name: "unknown", numa: true, topology: func() (int, int, error) { return 0, 0, errors.New("no getcpu") },
			wantNode: -1, wantLog: "cannot tell this CPU's NUMA node"},
		{name: "off", topology: func() (int, int, error) { panic("consulted with NUMA off") }, wantNode: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old := currentNUMANode
			currentNUMANode = tc.topology
			t.Cleanup(func() { currentNUMANode = old })
			var logs syncBuffer
			g := newG1(t, layout.TRTLLM)
			w, err := New(Options{HostBlocks: 4, NUMA: tc.numa, Metrics: metrics.New(),
				Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			require.NoError(t, err)
			require.NoError(t, w.RegisterG1(g.e))
			defer func() { require.NoError(t, w.Close()) }()
			require.Equal(t, tc.wantNode, w.host.NUMANode())
			require.Contains(t, logs.String(), tc.wantLog)

			want := g.block(3)
			_, failed := run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{3}, plan.G2, []int64{1})})
			require.Empty(t, failed)
			_, failed = run(t, w, &plan.Step{Seq: 2, Loads: []plan.Load{{ReqID: "r",
				Copies: copies(plan.G2, []int64{1}, plan.G1, []int64{0})}}})
			require.Empty(t, failed)
			require.Equal(t, want, g.block(0))
		})
	}
}
