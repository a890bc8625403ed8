package storage

import (
	"bytes"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// noFallocate makes fallocate unsupported, as on Lustre or some network
// filesystems, for the rest of the test.
func noFallocate(t *testing.T) {
	t.Helper()
	old := fallocate
	fallocate = func(int, uint32, int64, int64) error { return unix.EOPNOTSUPP }
	t.Cleanup(func() { fallocate = old })
}

// allocated is the bytes the filesystem has allocated to path.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Stat(path, &st))
	return st.Blocks * 512
}

// TestZeroFillFallback: without fallocate, DYN_KVBM_DISK_ZEROFILL_FALLBACK
// allocates every byte of the tier (more than one 16 MiB chunk here) and the
// tier then works, with O_DIRECT where the filesystem takes it and with
// buffered I/O; without it the file is sparse.
func TestZeroFillFallback(t *testing.T) {
	const blocks, blockBytes = 1500, 10000 // stride 12288: 18 MB, two chunks
	const size = blocks * 12288
	for _, tc := range []struct {
		name             string
		zeroFill, direct bool
	}{
		{"zero-fill, O_DIRECT", true, true},
		{"zero-fill, buffered", true, false},
		{"sparse, buffered", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			noFallocate(t)
			d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: blocks, BlockBytes: blockBytes,
				DisableODirect: !tc.direct, ZeroFill: tc.zeroFill})
			require.NoError(t, err)
			defer func() { require.NoError(t, d.Close()) }()
			if tc.direct {
				require.Equal(t, fsTakesODirect(t, dir), d.Direct())
			} else {
				require.False(t, d.Direct())
			}
			fi, err := os.Stat(d.Path())
			require.NoError(t, err)
			require.Equal(t, int64(size), fi.Size(), "the last write is rounded up to a page, then cut back")
			if tc.zeroFill {
				require.GreaterOrEqual(t, allocated(t, d.Path()), int64(size), "zero-fill left holes")
			} else {
				require.Less(t, allocated(t, d.Path()), int64(size), "the fallback without zero-fill is sparse")
			}
			roundTrip(t, d)
		})
	}
}

// TestZeroFillKeepsExistingBytes: a file that already holds data (a
// persistent tier being grown) keeps it, including an unaligned tail that
// shares its page with the first zeros, under O_DIRECT and buffered I/O.
func TestZeroFillKeepsExistingBytes(t *testing.T) {
	for _, direct := range []bool{true, false} {
		dir := t.TempDir()
		path := filepath.Join(dir, "tier")
		old := bytes.Repeat([]byte{0xab}, 5000)
		require.NoError(t, os.WriteFile(path, old, 0o600))
		fd, odirect, err := openTierFile(path, 0, direct, false, slog.Default())
		require.NoError(t, err)
		d := &DiskRegion{fd: fd, path: path, direct: odirect}
		const size = 3*zeroFillChunk + 3*Alignment // several chunks and a short last one
		require.NoError(t, d.zeroFill(size))
		require.NoError(t, unix.Close(fd))
		got, err := os.ReadFile(path)
		require.NoError(t, err)
		require.Len(t, got, size)
		require.Equal(t, old, got[:len(old)], "direct=%v: existing bytes overwritten", direct)
		require.Zero(t, bytes.Count(got[len(old):], []byte{0xab}), "direct=%v: not zeros past the old end", direct)
		require.GreaterOrEqual(t, allocated(t, path), int64(size))
	}
}

// TestDiskAllocatorType: DYN_KVBM_DISK_ALLOCATOR_TYPE=default opens the
// tier file without O_DIRECT and sets it afterwards; open-direct passes it
// to open. Either way the file ends with O_DIRECT on where the filesystem
// takes it, and DYN_KVBM_DISK_DISABLE_O_DIRECT wins over both.
func TestDiskAllocatorType(t *testing.T) {
	dir := t.TempDir()
	takes := fsTakesODirect(t, dir)
	for _, tc := range []struct {
		name                    string
		openDirect, disable     bool
		wantOpenFlag, wantFinal bool
	}{
		{name: "default", wantFinal: takes},
		{name: "open-direct", openDirect: true, wantOpenFlag: true, wantFinal: takes},
		{name: "default, O_DIRECT disabled", disable: true},
		{name: "open-direct, O_DIRECT disabled", openDirect: true, disable: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var opened []int
			old := openFile
			openFile = func(path string, flags int, mode uint32) (int, error) {
				opened = append(opened, flags)
				return old(path, flags, mode)
			}
			t.Cleanup(func() { openFile = old })
			d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: 4096,
				OpenDirect: tc.openDirect, DisableODirect: tc.disable})
			require.NoError(t, err)
			defer func() { require.NoError(t, d.Close()) }()
			require.NotEmpty(t, opened)
			require.Equal(t, tc.wantOpenFlag, opened[0]&unix.O_DIRECT != 0, "O_DIRECT in the open flags")
			flags, err := unix.FcntlInt(uintptr(d.fd), unix.F_GETFL, 0)
			require.NoError(t, err)
			require.Equal(t, tc.wantFinal, flags&unix.O_DIRECT != 0, "O_DIRECT on the open file")
			require.Equal(t, tc.wantFinal, d.Direct())
			roundTrip(t, d)
		})
	}
}

// TestZeroFillPersistentTierGrows: a persistent tier reopened larger on a
// filesystem without fallocate is zero-filled past its old end; the blocks
// it held are recovered intact, and every byte is allocated.
func TestZeroFillPersistentTierGrows(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(5, 6))
	d := openP(t, dir, fpA, 3)
	want := map[int][]byte{}
	for i := range 3 {
		want[i] = writeP(t, d, rng, i, uint64(20+i), true)
	}
	require.NoError(t, d.Close())

	noFallocate(t)
	d2, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 300, BlockBytes: pBlockBytes, Persist: true,
		Fingerprint: fpA, ZeroFill: true, Key: testKey})
	require.NoError(t, err)
	defer func() { require.NoError(t, d2.Close()) }()
	rec := d2.Recovery()
	require.Len(t, rec.Blocks, 3)
	require.Equal(t, 297, rec.Empty)
	for _, b := range rec.Blocks {
		require.Equal(t, want[b.Index], readP(t, d2, b.Index))
	}
	size := 300 * d2.slot
	fi, err := os.Stat(d2.Path())
	require.NoError(t, err)
	require.Equal(t, size, fi.Size())
	require.GreaterOrEqual(t, allocated(t, d2.Path()), size)
}
