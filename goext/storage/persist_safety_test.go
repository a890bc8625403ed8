package storage

import (
	"encoding/binary"
	"errors"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/integrity"
)

// A hostile neighbour's tools: read and rewrite a tier file's slots, and
// recompute what needs no key (the XXH3 checksums).

func readAt(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	b := make([]byte, n)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	return b
}

func writeAt(t *testing.T, path string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
}

// reseal recomputes a header's XXH3, as anyone can.
func reseal(h []byte) {
	binary.LittleEndian.PutUint64(h[headerSumAt:], xxh3.Hash(h[:headerSumAt]))
}

// writeTier writes n tagged blocks and closes the tier; it returns the
// payloads, the slot size and the file.
func writeTier(t *testing.T, dir string, n int, seed uint64) (payloads [][]byte, slot int64, path string) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed+1))
	d := openP(t, dir, fpA, n)
	for i := range n {
		payloads = append(payloads, writeP(t, d, rng, i, uint64(100+i), true))
	}
	slot, path = d.slot, d.Path()
	require.NoError(t, d.Close())
	return payloads, slot, path
}

// TestPersistentForgedHeadersNotRecovered: headers built without the key
// (by a writer who recomputed every checksum) are not recovered, and
// neither are they under another key.
func TestPersistentForgedHeadersNotRecovered(t *testing.T) {
	dir := t.TempDir()
	_, slot, path := writeTier(t, dir, 3, 1)

	// Block 0: the attacker's own KV under block 0's claimed hash: the
	// payload replaced, the header's payload XXH3 and own XXH3 recomputed.
	evil := make([]byte, pBlockBytes)
	for i := range evil {
		evil[i] = 0xEE
	}
	writeAt(t, path, HeaderBytes, evil)
	h := readAt(t, path, 0, HeaderBytes)
	binary.LittleEndian.PutUint64(h[72:], xxh3.Hash(evil))
	reseal(h)
	writeAt(t, path, 0, h)
	// Block 1: its sequence hash changed to one the attacker wants served.
	h = readAt(t, path, slot, HeaderBytes)
	binary.LittleEndian.PutUint64(h[40:], 0xBAD)
	reseal(h)
	writeAt(t, path, slot, h)
	// Block 2: a whole header built with another key.
	other := &DiskRegion{fp: fpA, blockBytes: pBlockBytes, key: mustKey("the attacker's own secret")}
	var mac [integrity.Size]byte
	h = make([]byte, HeaderBytes)
	other.encodeHeader(h, 2, &BlockHeader{SeqHash: 0xBAD2, PayloadSum: xxh3.Hash(evil)}, &mac)
	writeAt(t, path, 2*slot, h)
	writeAt(t, path, 2*slot+HeaderBytes, evil)

	d := openP(t, dir, fpA, 3)
	rec := d.Recovery()
	require.Empty(t, rec.Blocks, "no forged block is recovered")
	require.Equal(t, map[string]int{DiscardUnauthenticated: 3}, rec.Discarded)
	require.NoError(t, d.Close())

	// The tier's own blocks do not verify under another secret either.
	dir2 := t.TempDir()
	writeTier(t, dir2, 2, 2)
	d2, err := NewDiskRegion(DiskOptions{Dir: dir2, NumBlocks: 2, BlockBytes: pBlockBytes, Persist: true,
		Fingerprint: fpA, Key: mustKey("another storage secret 0123"), Logger: slog.New(slog.NewTextHandler(t.Output(), nil))})
	require.NoError(t, err)
	defer d2.Close()
	require.Empty(t, d2.Recovery().Blocks)
	require.Equal(t, 2, d2.Recovery().Discarded[DiscardUnauthenticated])
}

// TestPersistentSwappedPayloadsNotServed: two blocks' payloads swapped on
// disk. With the headers left alone both recover (the headers are
// authentic) but neither payload verifies at load; with the headers'
// payload checksums swapped too (recomputable without the key), neither
// header verifies.
func TestPersistentSwappedPayloadsNotServed(t *testing.T) {
	for _, fixHeaders := range []bool{false, true} {
		dir := t.TempDir()
		payloads, slot, path := writeTier(t, dir, 3, 3)
		p0 := readAt(t, path, HeaderBytes, pBlockBytes)
		p1 := readAt(t, path, slot+HeaderBytes, pBlockBytes)
		writeAt(t, path, HeaderBytes, p1)
		writeAt(t, path, slot+HeaderBytes, p0)
		if fixHeaders {
			h0, h1 := readAt(t, path, 0, HeaderBytes), readAt(t, path, slot, HeaderBytes)
			s0, s1 := binary.LittleEndian.Uint64(h0[72:]), binary.LittleEndian.Uint64(h1[72:])
			binary.LittleEndian.PutUint64(h0[72:], s1)
			binary.LittleEndian.PutUint64(h1[72:], s0)
			reseal(h0)
			reseal(h1)
			writeAt(t, path, 0, h0)
			writeAt(t, path, slot, h1)
		}

		d := openP(t, dir, fpA, 3)
		rec := d.Recovery()
		if fixHeaders {
			require.Len(t, rec.Blocks, 1)
			require.Equal(t, 2, rec.Blocks[0].Index)
			require.Equal(t, 2, rec.Discarded[DiscardUnauthenticated])
			continue
		}
		require.Len(t, rec.Blocks, 3)
		for _, i := range []int{0, 1} {
			err := d.VerifyRecovered(i, readP(t, d, i))
			require.ErrorIs(t, err, ErrUnauthenticated, "block %d", i)
		}
		got := readP(t, d, 2)
		require.Equal(t, payloads[2], got)
		require.NoError(t, d.VerifyRecovered(2, got), "an untouched block verifies")
		// A rewritten block is this process's own: nothing recorded to check.
		writeP(t, d, rand.New(rand.NewPCG(1, 1)), 0, 100, true)
		require.NoError(t, d.VerifyRecovered(0, readP(t, d, 0)))
	}
}

// TestPersistentOldFormatReinitialised: a file of format version 1 (no
// MACs: anyone could have written it) recovers nothing and is emptied.
func TestPersistentOldFormatReinitialised(t *testing.T) {
	dir := t.TempDir()
	_, slot, path := writeTier(t, dir, 3, 4)
	for i := range 3 {
		h := readAt(t, path, int64(i)*slot, HeaderBytes)
		binary.LittleEndian.PutUint32(h[8:], 1)
		reseal(h)
		writeAt(t, path, int64(i)*slot, h)
	}
	d := openP(t, dir, fpA, 3)
	rec := d.Recovery()
	require.True(t, rec.Reinitialised)
	require.Empty(t, rec.Blocks)
	require.Equal(t, map[string]int{DiscardVersion: 3}, rec.Discarded)
	require.Equal(t, 3, rec.Empty)
	require.Equal(t, make([]byte, HeaderBytes), readAt(t, path, slot, HeaderBytes), "the old headers are gone")
	require.NoError(t, d.Close())
}

// TestPersistentPlantedFileRefused: a tier file that another user could
// have written is never opened as this tier's: one of another owner (as
// root), one writable by others, a symlink, a hard link.
func TestPersistentPlantedFileRefused(t *testing.T) {
	open := func(dir string) error {
		d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 3, BlockBytes: pBlockBytes, Persist: true,
			Fingerprint: fpA, Key: testKey, Logger: slog.New(slog.NewTextHandler(t.Output(), nil))})
		if err == nil {
			_ = d.Close()
		}
		return err
	}
	t.Run("other owner", func(t *testing.T) {
		if os.Geteuid() != 0 {
			t.Skip("needs root to give a file to another user (uid 65534); the mode and link cases run as any user")
		}
		dir := t.TempDir()
		_, _, path := writeTier(t, dir, 3, 5)
		require.NoError(t, os.Chown(path, 65534, 65534))
		err := open(dir)
		require.ErrorIs(t, err, integrity.ErrUnsafe)
		require.ErrorContains(t, err, "uid 65534")
	})
	t.Run("mode 0666", func(t *testing.T) {
		dir := t.TempDir()
		_, _, path := writeTier(t, dir, 3, 6)
		require.NoError(t, os.Chmod(path, 0o666))
		err := open(dir)
		require.ErrorIs(t, err, integrity.ErrUnsafe)
		require.ErrorContains(t, err, "writable by group or others")
	})
	t.Run("symlink", func(t *testing.T) {
		dir, elsewhere := t.TempDir(), t.TempDir()
		_, _, target := writeTier(t, elsewhere, 3, 7)
		before, err := os.ReadFile(target)
		require.NoError(t, err)
		require.NoError(t, os.Symlink(target, PersistentPath(dir, fpA, 0)))
		err = open(dir)
		require.ErrorIs(t, err, integrity.ErrUnsafe)
		require.ErrorContains(t, err, "symlink")
		after, err := os.ReadFile(target)
		require.NoError(t, err)
		require.Equal(t, before, after, "the symlink's target is not touched")
	})
	t.Run("hard link", func(t *testing.T) {
		dir := t.TempDir()
		_, _, path := writeTier(t, dir, 3, 8)
		require.NoError(t, os.Link(path, filepath.Join(dir, "other-name")))
		err := open(dir)
		require.ErrorIs(t, err, integrity.ErrUnsafe)
		require.ErrorContains(t, err, "2 links")
	})
	t.Run("own file", func(t *testing.T) {
		dir := t.TempDir()
		_, _, path := writeTier(t, dir, 3, 9)
		fi, err := os.Stat(path)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "a tier file is created private")
		require.NoError(t, open(dir))
	})
}

// TestPersistentSharedDirRefused: a directory others can write, sticky or
// not, is refused for a persistent tier, naming DYN_KVBM_DISK_CACHE_DIR;
// a missing one is created private.
func TestPersistentSharedDirRefused(t *testing.T) {
	for _, mode := range []os.FileMode{0o777, 0o777 | os.ModeSticky, 0o775} {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, mode))
		_, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 3, BlockBytes: pBlockBytes, Persist: true,
			Fingerprint: fpA, Key: testKey})
		require.ErrorIs(t, err, integrity.ErrUnsafe, "mode %v", mode)
		require.ErrorContains(t, err, "DYN_KVBM_DISK_CACHE_DIR=")
		require.ErrorContains(t, err, "private subdirectory")
		entries, _ := os.ReadDir(dir)
		require.Empty(t, entries, "nothing is created there")
	}
	dir := filepath.Join(t.TempDir(), "new", "kvbm")
	d := openP(t, dir, fpA, 2)
	require.True(t, d.Persistent())
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
}

// TestPersistentHugeSparseFileBounded: a tier file grown (sparse) to 1 TB
// is cut to the configured size at start, and recovery reads only the
// configured slots' headers.
func TestPersistentHugeSparseFileBounded(t *testing.T) {
	dir := t.TempDir()
	payloads, _, path := writeTier(t, dir, 4, 10)
	if err := os.Truncate(path, 1<<40); err != nil {
		if errors.Is(err, syscall.EFBIG) {
			t.Skipf("this filesystem has no 1 TB files: %v", err)
		}
		require.NoError(t, err)
	}
	d := openP(t, dir, fpA, 4)
	rec := d.Recovery()
	require.Equal(t, 4, rec.HeadersRead)
	require.Len(t, rec.Blocks, 4)
	for _, b := range rec.Blocks {
		require.Equal(t, payloads[b.Index], readP(t, d, b.Index))
	}
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, 4*d.slot, fi.Size(), "the file is cut to the configured tier")
}

// TestNonPersistentFileSafe: the non-persistent tier file is created
// O_EXCL|O_NOFOLLOW, private, and a stale file of another user is left
// alone.
func TestNonPersistentFileSafe(t *testing.T) {
	dir := t.TempDir()
	var flags []int
	old := openFile
	openFile = func(path string, f int, mode uint32) (int, error) {
		flags = append(flags, f)
		return old(path, f, mode)
	}
	t.Cleanup(func() { openFile = old })
	d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: pBlockBytes, DisableODirect: true})
	require.NoError(t, err)
	defer d.Close()
	require.NotEmpty(t, flags)
	for _, f := range flags {
		require.Equal(t, syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW, f&(syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW))
	}
	fi, err := os.Stat(d.Path())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	if os.Geteuid() == 0 {
		stale := filepath.Join(dir, diskFilePrefix+"1-rank0-other")
		require.NoError(t, os.WriteFile(stale, []byte("x"), 0o644))
		require.NoError(t, os.Chown(stale, 65534, 65534))
		d2, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: 2, BlockBytes: pBlockBytes, DisableODirect: true})
		require.NoError(t, err)
		require.NoError(t, d2.Close())
		require.FileExists(t, stale, "another user's file is not this process's to remove")
	}
}
