package storage

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestHostRegion(t *testing.T) {
	r, err := NewHostRegion(5, 5000, true)
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	require.Equal(t, int64(8192), r.Stride())
	for i := 0; i < r.NumBlocks(); i++ {
		b := r.Block(i)
		require.Len(t, b, 5000)
		require.Equal(t, 5000, cap(b), "a payload slice must not reach into the next block")
		require.Len(t, r.IOBlock(i), 8192)
		require.Zero(t, uintptr(unsafe.Pointer(&b[0]))%Alignment, "block %d not aligned", i)
		for j := range b {
			b[j] = byte(i)
		}
	}
	for i := 0; i < r.NumBlocks(); i++ {
		require.Equal(t, bytes.Repeat([]byte{byte(i)}, 5000), r.Block(i))
	}
}

func TestHostRegionErrors(t *testing.T) {
	_, err := NewHostRegion(0, 100, false)
	require.ErrorContains(t, err, "must be > 0")
	_, err = NewHostRegion(1<<30, 1<<30, false)
	require.ErrorContains(t, err, "DYN_KVBM_CPU_CACHE_GB")
}

func newBuf(t *testing.T, n int64) []byte {
	t.Helper()
	b, err := mapAnon(n, false)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

func roundTrip(t *testing.T, d *DiskRegion) {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	want := make([][]byte, d.NumBlocks())
	buf := newBuf(t, d.Stride())
	for _, i := range rng.Perm(d.NumBlocks()) {
		for j := range buf {
			buf[j] = byte(rng.Uint32())
		}
		want[i] = bytes.Clone(buf)
		require.NoError(t, d.WriteBlock(i, buf))
	}
	for i := range want {
		clear(buf)
		require.NoError(t, d.ReadBlock(i, buf))
		require.Equal(t, want[i], buf, "block %d", i)
	}
}

func TestDiskRoundTrip(t *testing.T) {
	cases := []struct {
		name          string
		dir           string
		disableDirect bool
		failProbe     bool
		wantDirect    *bool
	}{
		{name: "real disk, O_DIRECT", dir: t.TempDir()},
		{name: "O_DIRECT disabled", dir: t.TempDir(), disableDirect: true, wantDirect: new(false)},
		{name: "O_DIRECT I/O fails, falls back", dir: t.TempDir(), failProbe: true, wantDirect: new(false)},
		{name: "tmpfs", dir: "/dev/shm"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := os.Stat(tc.dir); err != nil {
				t.Skipf("%s not available: %v", tc.dir, err)
			}
			if tc.failProbe {
				old := probeDirect
				probeDirect = func(int) error { return unix.EINVAL }
				t.Cleanup(func() { probeDirect = old })
			}
			d, err := NewDiskRegion(DiskOptions{Dir: tc.dir, Rank: 3, NumBlocks: 7, BlockBytes: 10000, DisableODirect: tc.disableDirect})
			require.NoError(t, err)
			path := d.Path()
			require.Equal(t, tc.dir, filepath.Dir(path))
			require.Contains(t, filepath.Base(path), "rank3")
			st, err := os.Stat(path)
			require.NoError(t, err)
			require.Equal(t, int64(7*12288), st.Size())
			if tc.wantDirect != nil {
				require.Equal(t, *tc.wantDirect, d.Direct())
			}
			roundTrip(t, d)
			require.NoError(t, d.Close())
			_, err = os.Stat(path)
			require.ErrorIs(t, err, os.ErrNotExist, "Close must remove the file")
		})
	}
}

func TestDiskErrors(t *testing.T) {
	dir := t.TempDir()
	notDir := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(notDir, nil, 0o600))

	_, err := NewDiskRegion(DiskOptions{Dir: filepath.Join(notDir, "sub"), NumBlocks: 1, BlockBytes: 10})
	require.ErrorContains(t, err, "DYN_KVBM_DISK_CACHE_DIR")

	// More than the filesystem can hold (or than ext4 allows in one file).
	_, err = NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 1 << 30, BlockBytes: 1 << 30})
	require.ErrorContains(t, err, "disk tier needs")
	require.ErrorContains(t, err, "DYN_KVBM_DISK_CACHE_GB")
	// Just more than the free space: fallocate says ENOSPC.
	var fs unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &fs))
	free := int64(fs.Bavail) * fs.Bsize
	_, err = NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: int(free>>30) + 2, BlockBytes: 1 << 30})
	require.ErrorIs(t, err, unix.ENOSPC)
	require.ErrorContains(t, err, "disk tier needs")
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, left, 1, "a failed preallocation must not leave its file behind")

	d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: 4096})
	require.NoError(t, err)
	defer func() { require.NoError(t, d.Close()) }()
	buf := newBuf(t, 2*4096)
	require.ErrorContains(t, d.WriteBlock(2, buf[:4096]), "out of range")
	require.ErrorContains(t, d.WriteBlock(0, buf), "want the stride")
	// Where the filesystem takes O_DIRECT (ext4, xfs: CI's disk), the tier
	// must use it, and then refuse unaligned buffers.
	require.Equal(t, fsTakesODirect(t, dir), d.Direct())
	if d.Direct() {
		require.ErrorContains(t, d.WriteBlock(0, buf[1:4097]), "aligned")
	}
}

// fsTakesODirect probes dir's filesystem independently of the disk tier: an
// aligned O_DIRECT write and read of one block.
func fsTakesODirect(t *testing.T, dir string) bool {
	t.Helper()
	path := filepath.Join(dir, "odirect-probe")
	defer os.Remove(path)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT, 0o600)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	buf := newBuf(t, 4096)
	if n, err := unix.Pwrite(fd, buf, 0); err != nil || n != len(buf) {
		return false
	}
	n, err := unix.Pread(fd, buf, 0)
	return err == nil && n == len(buf)
}

// TestStaleDiskFilesRemoved: a crashed process leaves its disk tier file
// behind; the next disk tier in that directory removes it, but never a file
// that some process holds locked, whatever pid its name carries (pids from
// another PID namespace mean nothing here).
func TestStaleDiskFilesRemoved(t *testing.T) {
	dir := t.TempDir()
	// A pid above the kernel's maximum (4194304) cannot be running here,
	// yet a worker in another PID namespace may hold the file.
	lockedForeign := filepath.Join(dir, "kvbm-disk-cache-4194399-rank0-deadbeef")
	// pid 1 runs, but nobody holds this file: it is stale.
	unlockedLive := filepath.Join(dir, "kvbm-disk-cache-1-rank1-cafebabe")
	unlockedOdd := filepath.Join(dir, "kvbm-disk-cache-notapid-rank0-x")
	unrelated := filepath.Join(dir, "other-file")
	for _, p := range []string{lockedForeign, unlockedLive, unlockedOdd, unrelated} {
		require.NoError(t, os.WriteFile(p, []byte("x"), 0o600))
	}
	// Another open file description holds the lock, as another process's
	// tier would.
	f, err := os.Open(lockedForeign)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB))

	d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: 4096, DisableODirect: true})
	require.NoError(t, err)
	defer d.Close()
	require.NoFileExists(t, unlockedLive, "unlocked file kept")
	require.NoFileExists(t, unlockedOdd, "unlocked file kept")
	require.FileExists(t, lockedForeign, "a locked file was removed")
	require.FileExists(t, unrelated)
	require.FileExists(t, d.Path())
}

// TestDiskFileLockedForItsLifetime: a live tier's file cannot be locked by
// anyone else, so a second tier's cleanup in the same directory keeps it,
// and Close releases it by removing it.
func TestDiskFileLockedForItsLifetime(t *testing.T) {
	dir := t.TempDir()
	for _, direct := range []bool{false, true} {
		d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: 4096, DisableODirect: !direct})
		require.NoError(t, err)
		f, err := os.Open(d.Path())
		require.NoError(t, err)
		require.ErrorIs(t, unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB), unix.EWOULDBLOCK)
		require.NoError(t, f.Close())

		d2, err := NewDiskRegion(DiskOptions{Dir: dir, Rank: 1, NumBlocks: 2, BlockBytes: 4096, DisableODirect: true})
		require.NoError(t, err)
		require.FileExists(t, d.Path(), "cleanup removed a live tier's file")
		path := d.Path()
		require.NoError(t, d.Close())
		require.NoFileExists(t, path)
		require.NoError(t, d2.Close())
	}
}

// TestDiskFileLockSurvivesDroppingODirect: a filesystem that accepts
// O_DIRECT at open but fails its I/O makes the tier fall back to buffered
// I/O; the file stays locked across the switch.
func TestDiskFileLockSurvivesDroppingODirect(t *testing.T) {
	old := probeDirect
	probeDirect = func(int) error { return unix.EINVAL }
	t.Cleanup(func() { probeDirect = old })
	d, err := NewDiskRegion(DiskOptions{Dir: t.TempDir(), NumBlocks: 2, BlockBytes: 4096})
	require.NoError(t, err)
	defer d.Close()
	require.False(t, d.Direct())
	f, err := os.Open(d.Path())
	require.NoError(t, err)
	defer f.Close()
	require.ErrorIs(t, unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB), unix.EWOULDBLOCK)
}
