package storage

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestHostRegionOnNode: the region's pages carry the policy that prefers
// the node asked for (read back with get_mempolicy); a plain region keeps
// the default policy. The node is the calling CPU's, as for a worker.
func TestHostRegionOnNode(t *testing.T) {
	node, nodes, err := CurrentNUMANode()
	require.NoError(t, err)
	require.GreaterOrEqual(t, nodes, 1)
	require.Less(t, node, nodes)

	r, err := NewHostRegionOnNode(4, 5000, true, node)
	if errors.Is(err, ErrNUMAPolicy) && errors.Is(err, unix.EPERM) {
		t.Skipf("this sandbox refuses memory policies: %v", err)
	}
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	for i := range r.NumBlocks() {
		mode, mask, err := memPolicy(unsafe.Pointer(unsafe.SliceData(r.IOBlock(i))))
		require.NoError(t, err)
		require.Equal(t, mpolPreferred, mode, "block %d", i)
		require.Equal(t, uint64(1)<<node, mask, "block %d", i)
	}
	copy(r.Block(3), "still memory")
	require.Equal(t, "still memory", string(r.Block(3)[:12]))

	plain, err := NewHostRegion(2, 4096, true)
	require.NoError(t, err)
	defer func() { require.NoError(t, plain.Close()) }()
	mode, _, err := memPolicy(unsafe.Pointer(unsafe.SliceData(plain.IOBlock(0))))
	require.NoError(t, err)
	require.Equal(t, mpolDefault, mode)

	_, err = NewHostRegionOnNode(1, 4096, false, maxNUMANodes)
	require.ErrorIs(t, err, ErrNUMAPolicy)
}

func TestOnlineNUMANodes(t *testing.T) {
	dir := t.TempDir()
	for list, want := range map[string]int{"0\n": 1, "0-3\n": 4, "0,2-3": 3} {
		p := filepath.Join(dir, "online")
		require.NoError(t, os.WriteFile(p, []byte(list), 0o600))
		n, err := onlineNUMANodes(p)
		require.NoError(t, err)
		require.Equal(t, want, n, list)
	}
	n, err := onlineNUMANodes(filepath.Join(dir, "absent"))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "bad"), []byte("3-1"), 0o600))
	_, err = onlineNUMANodes(filepath.Join(dir, "bad"))
	require.Error(t, err)
}
