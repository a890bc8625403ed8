package storage

import (
	"bytes"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
)

const pBlockBytes = 6000 // not a multiple of Alignment: the padding must not matter

var fpA = fingerprint.Inputs{Model: "model-a", DType: "torch.bfloat16", BlockSize: 4, TPSize: 1}.Sum()
var fpB = fingerprint.Inputs{Model: "model-b", DType: "torch.bfloat16", BlockSize: 4, TPSize: 1}.Sum()

// testKey keys the tiers of these tests (an override: no secret file).
var testKey = mustKey("storage test secret 0123456789")

func mustKey(secret string) integrity.Key {
	k, err := integrity.LocalKey([]byte(secret), "")
	if err != nil {
		panic(err)
	}
	return k
}

func openP(t *testing.T, dir string, fp fingerprint.Fingerprint, n int) *DiskRegion {
	t.Helper()
	d, err := NewDiskRegion(DiskOptions{Dir: dir, NumBlocks: n, BlockBytes: pBlockBytes, Persist: true,
		Fingerprint: fp, Key: testKey, Logger: slog.New(slog.NewTextHandler(t.Output(), nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// writeP writes block i with random payload and a header naming hash, and
// returns the payload.
func writeP(t *testing.T, d *DiskRegion, rng *rand.Rand, i int, hash uint64, tagged bool) []byte {
	t.Helper()
	buf := alignedBuf(int(d.Stride()))
	for j := range buf {
		buf[j] = byte(rng.Uint32())
	}
	var h *BlockHeader
	if tagged {
		h = &BlockHeader{SeqHash: hash, Parent: hash - 1, HasParent: i > 0, Priority: int32(i),
			Tokens: []uint32{uint32(i), 7, 8, 9}, PayloadSum: xxh3.Hash(buf[:pBlockBytes]), WrittenAt: int64(1000 + i)}
	}
	require.NoError(t, d.WriteBlockHeader(i, buf, h))
	return bytes.Clone(buf[:pBlockBytes])
}

func readP(t *testing.T, d *DiskRegion, i int) []byte {
	t.Helper()
	buf := alignedBuf(int(d.Stride()))
	require.NoError(t, d.ReadBlock(i, buf))
	return buf[:pBlockBytes]
}

func TestPersistentRoundTrip(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(3, 4))
	d := openP(t, dir, fpA, 6)
	require.True(t, d.Persistent())
	require.Equal(t, PersistentPath(dir, fpA, 0), d.Path())
	require.False(t, d.Recovery().Reused)
	require.Equal(t, 6, d.Recovery().Empty)
	want := map[int][]byte{}
	for _, i := range []int{0, 2, 3, 5} {
		want[i] = writeP(t, d, rng, i, uint64(100+i), true)
	}
	writeP(t, d, rng, 1, 101, false) // untagged: this process only
	// Rewriting a block without a tag makes its old header invalid.
	writeP(t, d, rng, 4, 104, true)
	writeP(t, d, rng, 4, 104, false)
	require.NoError(t, d.Close())
	require.FileExists(t, d.Path(), "a persistent tier file is kept at Close")

	d2 := openP(t, dir, fpA, 6)
	rec := d2.Recovery()
	require.True(t, rec.Reused)
	require.Equal(t, 6, rec.OldBlocks)
	require.Zero(t, rec.NumDiscarded(), "%v", rec.Discarded)
	require.Equal(t, 2, rec.Empty)
	var got []int
	for _, b := range rec.Blocks {
		got = append(got, b.Index)
		require.Equal(t, uint64(100+b.Index), b.SeqHash)
		require.Equal(t, uint64(99+b.Index), b.Parent)
		require.Equal(t, b.Index > 0, b.HasParent)
		require.Equal(t, int32(b.Index), b.Priority)
		require.Equal(t, []uint32{uint32(b.Index), 7, 8, 9}, b.Tokens)
		require.Equal(t, int64(1000+b.Index), b.WrittenAt)
		payload := readP(t, d2, b.Index)
		require.Equal(t, want[b.Index], payload, "block %d", b.Index)
		require.Equal(t, xxh3.Hash(payload), b.PayloadSum)
	}
	require.Equal(t, []int{0, 2, 3, 5}, got)
}

// TestPersistentTornHeader: a header with any byte changed (an interrupted
// write), a header copied to another slot, or one of another fingerprint is
// never recovered.
func TestPersistentTornHeader(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(5, 6))
	d := openP(t, dir, fpA, 5)
	for i := range 5 {
		writeP(t, d, rng, i, uint64(500+i), true)
	}
	slot := d.slot
	path := d.Path()
	require.NoError(t, d.Close())

	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	hdrAt := func(i int) int64 { return int64(i) * slot }
	// Block 1: one flipped bit in its tokens.
	b := make([]byte, 1)
	_, err = f.ReadAt(b, hdrAt(1)+headerFixed)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte{b[0] ^ 0x10}, hdrAt(1)+headerFixed)
	require.NoError(t, err)
	// Block 2: a header cut short (its second half zeroed).
	_, err = f.WriteAt(make([]byte, HeaderBytes/2), hdrAt(2)+HeaderBytes/2)
	require.NoError(t, err)
	// Block 3 gets block 0's header.
	h0 := make([]byte, HeaderBytes)
	_, err = f.ReadAt(h0, hdrAt(0))
	require.NoError(t, err)
	_, err = f.WriteAt(h0, hdrAt(3))
	require.NoError(t, err)
	require.NoError(t, f.Close())

	d2 := openP(t, dir, fpA, 5)
	rec := d2.Recovery()
	require.Len(t, rec.Blocks, 2)
	require.Equal(t, 0, rec.Blocks[0].Index)
	require.Equal(t, 4, rec.Blocks[1].Index)
	require.Equal(t, map[string]int{DiscardTorn: 2, DiscardMisplaced: 1}, rec.Discarded)
	require.NoError(t, d2.Close())

	// The same file under another fingerprint's name: every header names fpA.
	require.NoError(t, os.Rename(path, PersistentPath(dir, fpB, 0)))
	d3 := openP(t, dir, fpB, 5)
	require.Empty(t, d3.Recovery().Blocks)
	require.Equal(t, 3, d3.Recovery().Discarded[DiscardFingerprint]) // blocks 0, 4 and the copy in 3
}

// TestPersistentOtherFingerprintKept: an engine of another fingerprint gets
// its own file; the first one's file is neither reused nor removed, and a
// stale non-persistent file is still removed.
func TestPersistentOtherFingerprintKept(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(7, 8))
	d := openP(t, dir, fpA, 3)
	writeP(t, d, rng, 0, 1, true)
	require.NoError(t, d.Close())
	stale := filepath.Join(dir, diskFilePrefix+"1-rank0-dead")
	require.NoError(t, os.WriteFile(stale, []byte("x"), 0o600))

	d2 := openP(t, dir, fpB, 3)
	require.NotEqual(t, d.Path(), d2.Path())
	require.False(t, d2.Recovery().Reused)
	require.Empty(t, d2.Recovery().Blocks)
	require.FileExists(t, d.Path())
	require.NoFileExists(t, stale)
	require.NoError(t, d2.Close())

	d3 := openP(t, dir, fpA, 3)
	require.Len(t, d3.Recovery().Blocks, 1)
}

// TestPersistentSecondOpener: while one tier holds the persistent file, a
// second one in the same directory (another open file description, as a
// second process would have) gets a fresh non-persistent file of its own.
func TestPersistentSecondOpener(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(9, 10))
	d := openP(t, dir, fpA, 3)
	writeP(t, d, rng, 0, 1, true)
	d2 := openP(t, dir, fpA, 3)
	require.False(t, d2.Persistent())
	require.NotEqual(t, d.Path(), d2.Path())
	require.Empty(t, d2.Recovery().Blocks)
	// The second tier's writes never reach the first one's file.
	buf := alignedBuf(int(d2.Stride()))
	require.NoError(t, d2.WriteBlockHeader(0, buf, &BlockHeader{SeqHash: 9}))
	p2 := d2.Path()
	require.NoError(t, d2.Close())
	require.NoFileExists(t, p2, "the non-persistent file is removed at Close")
	require.NoError(t, d.Close())
	d3 := openP(t, dir, fpA, 3)
	require.Len(t, d3.Recovery().Blocks, 1)
	require.Equal(t, uint64(1), d3.Recovery().Blocks[0].SeqHash)
}

// TestPersistentResize: a smaller tier keeps the blocks still in range and
// drops the rest unread; a larger one keeps everything and adds empty blocks.
func TestPersistentResize(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(11, 12))
	d := openP(t, dir, fpA, 6)
	want := map[int][]byte{}
	for i := range 6 {
		want[i] = writeP(t, d, rng, i, uint64(10+i), true)
	}
	require.NoError(t, d.Close())

	d2 := openP(t, dir, fpA, 4)
	rec := d2.Recovery()
	require.Equal(t, 6, rec.OldBlocks)
	require.Len(t, rec.Blocks, 4)
	require.Empty(t, rec.Discarded)
	require.Equal(t, 4, rec.HeadersRead, "the slots past the new end are not read")
	st, err := os.Stat(d2.Path())
	require.NoError(t, err)
	require.Equal(t, 4*d2.slot, st.Size())
	require.NoError(t, d2.Close())

	d3 := openP(t, dir, fpA, 9)
	rec = d3.Recovery()
	require.Equal(t, 4, rec.OldBlocks)
	require.Len(t, rec.Blocks, 4)
	require.Equal(t, 5, rec.Empty)
	for _, b := range rec.Blocks {
		require.Equal(t, want[b.Index], readP(t, d3, b.Index))
	}
}

func TestHeaderTokensLimit(t *testing.T) {
	d := &DiskRegion{fp: fpA, blockBytes: 10, key: testKey}
	buf := make([]byte, HeaderBytes)
	many := make([]uint32, MaxHeaderTokens+1)
	var mac [integrity.Size]byte
	d.encodeHeader(buf, 3, &BlockHeader{SeqHash: 5, Tokens: many}, &mac)
	h, _, reason := d.decodeHeader(buf, 3)
	require.Empty(t, reason)
	require.Nil(t, h.Tokens, "tokens that do not fit are left out, not cut")
	full := make([]uint32, MaxHeaderTokens)
	full[len(full)-1] = 42
	d.encodeHeader(buf, 3, &BlockHeader{SeqHash: 5, Tokens: full}, &mac)
	h, _, reason = d.decodeHeader(buf, 3)
	require.Empty(t, reason)
	require.Equal(t, full, h.Tokens)
}

// TestPersistentPartialTrailingSlot: a file cut inside a slot (not by kvbm)
// keeps the headers that still verify in that slot, so the slot is
// invalidated before it is rewritten; its cut payload fails its checksum.
func TestPersistentPartialTrailingSlot(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(13, 14))
	d := openP(t, dir, fpA, 3)
	for i := range 3 {
		writeP(t, d, rng, i, uint64(20+i), true)
	}
	slot, path := d.slot, d.Path()
	require.NoError(t, d.Close())
	require.NoError(t, os.Truncate(path, 2*slot+HeaderBytes+100)) // block 2: header and 100 payload bytes

	d2 := openP(t, dir, fpA, 3)
	rec := d2.Recovery()
	require.Len(t, rec.Blocks, 3)
	require.Equal(t, 2, rec.OldBlocks)
	payload := readP(t, d2, 2)
	require.NotEqual(t, rec.Blocks[2].PayloadSum, xxh3.Hash(payload), "the cut payload must not verify")
	// Rewriting block 2 untagged invalidates the old header.
	writeP(t, d2, rng, 2, 99, false)
	require.NoError(t, d2.Close())
	d3 := openP(t, dir, fpA, 3)
	require.Len(t, d3.Recovery().Blocks, 2)
}
