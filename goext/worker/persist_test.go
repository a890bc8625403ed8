package worker

import (
	"encoding/binary"
	"fmt"
	"os"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
)

func persistOpts(g *g1, dir string, host int) Options {
	return Options{HostBlocks: host, DiskBlocks: 6, DiskDir: dir, DiskPersist: true, DisableODirect: true,
		Fingerprint: fingerprint.FromEngine("test-model", "torch.float16", g.e, 1, 0), DiskKey: testDiskKey}
}

// testDiskKey keys the persistent tiers of these tests (an override: no
// secret file under $HOME).
var testDiskKey = func() integrity.Key {
	k, err := integrity.LocalKey([]byte("worker test storage secret"), "")
	if err != nil {
		panic(err)
	}
	return k
}()

func tag(block int64, hash uint64) plan.BlockTag {
	return plan.BlockTag{Block: block, SeqHash: hash, Parent: hash - 1, HasParent: true, Priority: 3, Tokens: []uint32{1, 2, 3, 4}}
}

// TestPersistRecoversAcrossWorkers: blocks a worker wrote with tags are
// recovered by the next worker on the same directory, and load byte-exact;
// an untagged write, a tag naming a block the step does not write, and a
// dropped block are not recovered.
func TestPersistRecoversAcrossWorkers(t *testing.T) {
	dir := t.TempDir()
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, persistOpts(g, dir, 4))
	require.True(t, w.DiskPersistent())
	want := map[int64][]byte{2: g.block(3), 4: g.block(5)}
	// Disk-only style saves (G1→G3) and moves through G2.
	_, failed := run(t, w, &plan.Step{Seq: 1,
		Saves: copies(plan.G1, []int64{1, 2, 4}, plan.G3, []int64{0, 1, 3}),
		Tags:  []plan.BlockTag{tag(0, 100), tag(1, 101), tag(5, 105)}, // block 3 untagged; 5 not written
	})
	require.Empty(t, failed)
	run(t, w, &plan.Step{Seq: 2, Saves: copies(plan.G1, []int64{3, 5}, plan.G2, []int64{0, 1})})
	run(t, w, &plan.Step{Seq: 3, Moves: copies(plan.G2, []int64{0, 1}, plan.G3, []int64{2, 4}),
		Tags: []plan.BlockTag{tag(2, 102), tag(4, 104)}})
	// A dropped block's header goes; a block rewritten without a tag loses
	// its old one (the old tag must not label the new bytes).
	run(t, w, &plan.Step{Seq: 4, Drops: []plan.Copy{{Src: plan.G3, SrcBlock: 1}}})
	run(t, w, &plan.Step{Seq: 5, Saves: copies(plan.G1, []int64{7}, plan.G3, []int64{0})})
	require.NoError(t, w.Close())

	g.scramble()
	w2 := newWorker(t, g, persistOpts(g, dir, 4))
	rec := w2.Recovered()
	var idx []int
	for _, b := range rec.Blocks {
		idx = append(idx, b.Index)
		require.Equal(t, uint64(100+b.Index), b.SeqHash)
		require.Equal(t, uint64(99+b.Index), b.Parent)
		require.Equal(t, []uint32{1, 2, 3, 4}, b.Tokens)
	}
	require.Equal(t, []int{2, 4}, idx)
	loaded, failed := run(t, w2, &plan.Step{Seq: 1, Loads: []plan.Load{
		{ReqID: "r", Copies: copies(plan.G3, []int64{2, 4}, plan.G1, []int64{21, 22})},
	}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, want[2], g.block(21))
	require.Equal(t, want[4], g.block(22))
	// Blocks not recovered are not valid.
	_, failed = run(t, w2, &plan.Step{Seq: 2, Loads: []plan.Load{
		{ReqID: "x", Copies: copies(plan.G3, []int64{0, 1, 3}, plan.G1, []int64{20, 23, 24})},
	}})
	require.Equal(t, []int64{20, 23, 24}, failed)
}

// TestPersistCorruptPayloadNotServed: a block whose header verifies but
// whose payload changed on disk (a power loss persisted the header only,
// or the medium rotted) fails its load, and is not recovered again.
func TestPersistCorruptPayloadNotServed(t *testing.T) {
	dir := t.TempDir()
	g := newG1(t, layout.FlashAttn)
	w := newWorker(t, g, persistOpts(g, dir, 0))
	want := g.block(1)
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2}, plan.G3, []int64{0, 1}),
		Tags: []plan.BlockTag{tag(0, 10), tag(1, 11)}})
	require.NoError(t, w.Close())

	f, err := os.OpenFile(w.DiskPath(), os.O_RDWR, 0)
	require.NoError(t, err)
	slot := layout.AlignUp(g.e.BytesPerBlock(), storage.Alignment) + storage.HeaderBytes
	b := make([]byte, 1)
	_, err = f.ReadAt(b, slot+storage.HeaderBytes+7) // block 1's payload
	require.NoError(t, err)
	_, err = f.WriteAt([]byte{b[0] ^ 1}, slot+storage.HeaderBytes+7)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	w2 := newWorker(t, g, persistOpts(g, dir, 0))
	require.Len(t, w2.Recovered().Blocks, 2, "headers verify; the payload is checked on load")
	loaded, failed := run(t, w2, &plan.Step{Seq: 1, Loads: []plan.Load{
		{ReqID: "r", Copies: copies(plan.G3, []int64{0, 1}, plan.G1, []int64{30, 31})},
	}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, []int64{31}, failed)
	require.Equal(t, want, g.block(30))
	require.NoError(t, w2.Close())

	w3 := newWorker(t, g, persistOpts(g, dir, 0))
	require.Len(t, w3.Recovered().Blocks, 1, "a block that failed verification is forgotten on disk too")
	require.Equal(t, 0, w3.Recovered().Blocks[0].Index)
}

// TestPersistOtherFingerprint: a worker of another model never sees the
// first one's blocks.
func TestPersistOtherFingerprint(t *testing.T) {
	dir := t.TempDir()
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, persistOpts(g, dir, 0))
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1}, plan.G3, []int64{0}), Tags: []plan.BlockTag{tag(0, 10)}})
	require.NoError(t, w.Close())
	o := persistOpts(g, dir, 0)
	o.Fingerprint.Model = "another-model"
	w2 := newWorker(t, g, o)
	require.NotEqual(t, w.DiskPath(), w2.DiskPath())
	require.Empty(t, w2.Recovered().Blocks)
	_, failed := run(t, w2, &plan.Step{Seq: 1, Loads: []plan.Load{{ReqID: "r", Copies: copies(plan.G3, []int64{0}, plan.G1, []int64{9})}}})
	require.Equal(t, []int64{9}, failed)
	require.FileExists(t, w.DiskPath())
}

// TestPersistSideChannelMoveTakesHostTag: a G2→G3 move sent over the side
// channel carries only TagRefs; the G3 copy takes the tag the engine step
// that saved its G2 source carried, when the ids match. A wrong id, or a G2
// block rewritten without a tag, leaves the copy untagged; a dropped G2
// block loses its tag.
func TestPersistSideChannelMoveTakesHostTag(t *testing.T) {
	dir := t.TempDir()
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, persistOpts(g, dir, 4))
	host := func(block int64, id uint64, hash uint64) plan.HostTag {
		tg := tag(block, hash)
		tg.Tokens = []uint32{uint32(hash), 7, 8, 9}
		return plan.HostTag{ID: id, BlockTag: tg}
	}
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2, 3, 4}, plan.G2, []int64{0, 1, 2, 3}),
		HostTags: []plan.HostTag{host(0, 10, 100), host(1, 11, 101), host(2, 12, 102), host(3, 13, 103)}})
	// Block 2 is saved again without a tag; block 3 is dropped.
	run(t, w, &plan.Step{Seq: 2, Saves: copies(plan.G1, []int64{5}, plan.G2, []int64{2}),
		Drops: []plan.Copy{{Src: plan.G2, SrcBlock: 3}}})
	_, err := w.Run(t.Context(), &plan.Step{Seq: 2,
		Moves:   copies(plan.G2, []int64{0, 1, 2}, plan.G3, []int64{5, 4, 3}),
		TagRefs: []plan.TagRef{{Block: 5, ID: 10}, {Block: 4, ID: 99}, {Block: 3, ID: 12}}})
	require.NoError(t, err)
	require.Nil(t, w.hostTags[3].Load(), "a dropped G2 block keeps no tag")
	require.NotNil(t, w.hostTags[1].Load())
	require.NoError(t, w.Close())

	w2 := newWorker(t, g, persistOpts(g, dir, 4))
	rec := w2.Recovered()
	require.Len(t, rec.Blocks, 1, "only the move whose id matched its source's tag is kept")
	b := rec.Blocks[0]
	require.Equal(t, 5, b.Index)
	require.Equal(t, uint64(100), b.SeqHash)
	require.Equal(t, []uint32{100, 7, 8, 9}, b.Tokens)
	require.NoError(t, w2.Close())
}

// TestPersistSwappedPayloadsNotServed: two blocks whose payloads were
// swapped on disk (each payload a valid block's KV) are not served under
// each other's hash. With the headers left alone they are recovered, both
// loads fail, are counted, and neither block is recovered again; with the
// headers' payload checksums swapped and resealed too (what needs no key),
// neither is recovered.
func TestPersistSwappedPayloadsNotServed(t *testing.T) {
	for _, reseal := range []bool{false, true} {
		t.Run(fmt.Sprint("reseal=", reseal), func(t *testing.T) { testSwappedPayloads(t, reseal) })
	}
}

func testSwappedPayloads(t *testing.T, reseal bool) {
	dir := t.TempDir()
	g := newG1(t, layout.CPU)
	w := newWorker(t, g, persistOpts(g, dir, 0))
	want := g.block(3)
	run(t, w, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2, 3}, plan.G3, []int64{0, 1, 2}),
		Tags: []plan.BlockTag{tag(0, 10), tag(1, 11), tag(2, 12)}})
	require.NoError(t, w.Close())

	slot := layout.AlignUp(g.e.BytesPerBlock(), storage.Alignment) + storage.HeaderBytes
	n := int(g.e.BytesPerBlock())
	f, err := os.OpenFile(w.DiskPath(), os.O_RDWR, 0)
	require.NoError(t, err)
	p0, p1 := make([]byte, n), make([]byte, n)
	_, err = f.ReadAt(p0, storage.HeaderBytes)
	require.NoError(t, err)
	_, err = f.ReadAt(p1, slot+storage.HeaderBytes)
	require.NoError(t, err)
	_, err = f.WriteAt(p1, storage.HeaderBytes)
	require.NoError(t, err)
	_, err = f.WriteAt(p0, slot+storage.HeaderBytes)
	require.NoError(t, err)
	if reseal {
		h0, h1 := make([]byte, storage.HeaderBytes), make([]byte, storage.HeaderBytes)
		_, err = f.ReadAt(h0, 0)
		require.NoError(t, err)
		_, err = f.ReadAt(h1, slot)
		require.NoError(t, err)
		// The payload XXH3 sits at byte 72; the header's own XXH3 in its last 8.
		s0, s1 := binary.LittleEndian.Uint64(h0[72:]), binary.LittleEndian.Uint64(h1[72:])
		binary.LittleEndian.PutUint64(h0[72:], s1)
		binary.LittleEndian.PutUint64(h1[72:], s0)
		for _, h := range [][]byte{h0, h1} {
			binary.LittleEndian.PutUint64(h[len(h)-8:], xxh3.Hash(h[:len(h)-8]))
		}
		_, err = f.WriteAt(h0, 0)
		require.NoError(t, err)
		_, err = f.WriteAt(h1, slot)
		require.NoError(t, err)
	}
	require.NoError(t, f.Close())

	o := persistOpts(g, dir, 0)
	o.Metrics = metrics.New()
	w2 := newWorker(t, g, o)
	if reseal {
		require.Len(t, w2.Recovered().Blocks, 1)
		require.Equal(t, 2, w2.Recovered().Discarded[storage.DiscardUnauthenticated])
	} else {
		require.Len(t, w2.Recovered().Blocks, 3)
	}
	g.scramble()
	loaded, failed := run(t, w2, &plan.Step{Seq: 1, Loads: []plan.Load{
		{ReqID: "r", Copies: copies(plan.G3, []int64{0, 1, 2}, plan.G1, []int64{30, 31, 32})},
	}})
	require.Equal(t, []string{"r"}, loaded)
	require.ElementsMatch(t, []int64{30, 31}, failed)
	require.Equal(t, want, g.block(32), "the untouched block loads")
	if !reseal {
		require.Equal(t, 2.0, testutil.ToFloat64(o.Metrics.G3LoadUnauthenticated()))
	}
	require.NoError(t, w2.Close())

	w3 := newWorker(t, g, persistOpts(g, dir, 0))
	require.Len(t, w3.Recovered().Blocks, 1, "the blocks that did not verify are forgotten on disk")
	require.Equal(t, 2, w3.Recovered().Blocks[0].Index)
}

// TestPersistNeedsKey: a persistent tier without a key is refused.
func TestPersistNeedsKey(t *testing.T) {
	g := newG1(t, layout.CPU)
	o := persistOpts(g, t.TempDir(), 0)
	o.DiskKey = integrity.Key{}
	o.Metrics = metrics.New()
	w, err := New(o)
	require.NoError(t, err)
	defer w.Close()
	require.ErrorContains(t, w.RegisterG1(g.e), "no key to authenticate")
}
