package worker

import (
	"bytes"
	"context"
	"encoding/binary"
	"path"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/internal/s3test"
)

func g4Store(t *testing.T, srv *s3test.Server, fp fingerprint.Fingerprint, bpb int) *object.Store {
	t.Helper()
	c, err := object.NewClient(object.ClientOptions{Host: srv.Addr, Bucket: "kv-worker", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, c.EnsureBucket(ctx, "us-east-1"))
	s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp, BlockBytes: bpb,
		BreakerCooldown: 50 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

// TestG4UploadThenLoadElsewhere: instance A saves G1 blocks to G2 and uploads
// them; instance B (its own worker, store and empty registry, same bucket)
// loads them G4 → G2 → G1 byte exact. A corrupted object and a missing one
// are reported as failed G1 blocks, never loaded.
func TestG4UploadThenLoadElsewhere(t *testing.T) {
	srv := s3test.Start(t)
	fp := fingerprint.Inputs{Model: "m", DType: "bf16", BlockSize: bs, TPSize: 1}.Sum()

	ga := newG1(t, layout.FlashAttn)
	bpb := int(ga.e.BytesPerBlock())
	sa := g4Store(t, srv, fp, bpb)
	wa := newWorker(t, ga, Options{HostBlocks: 8, G4: sa})
	src := []int64{3, 17, 5}
	hashes := []uint64{0xa1, 0xa2, 0xa3}
	want := [][]byte{ga.block(3), ga.block(17), ga.block(5)}
	_, failed := run(t, wa, &plan.Step{Seq: 1, Saves: copies(plan.G1, src, plan.G2, []int64{0, 1, 2}),
		Uploads: []plan.Upload{{Block: 0, Hash: hashes[0]}, {Block: 1, Hash: hashes[1], Parent: hashes[0]},
			{Block: 2, Hash: hashes[2], Parent: hashes[1]}}})
	require.Empty(t, failed)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sa.Flush(ctx))

	gb := newG1(t, layout.FlashAttn)
	sb := g4Store(t, srv, fp, bpb)
	wb := newWorker(t, gb, Options{HostBlocks: 8, G4: sb})
	require.Equal(t, 3, sb.Lookup(ctx, hashes))

	// Damage the third object in the store, as a faulty disk or writer would.
	cl, err := object.NewClient(object.ClientOptions{Host: srv.Addr, Bucket: "kv-worker", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	require.NoError(t, cl.Delete(ctx, sb.Key(hashes[2])))
	bad := object.Encode(cl.ObjectKey(nil), fp, hashes[2], hashes[1], want[2])
	bad[len(bad)-1] ^= 1
	_, err = cl.PutIfAbsent(ctx, sb.Key(hashes[2]), bad)
	require.NoError(t, err)

	g1dst := []int64{30, 31, 32, 33}
	ld := plan.Load{ReqID: "r", Copies: []plan.Copy{
		{Src: plan.G4, SrcBlock: int64(hashes[0]), Dst: plan.G2, DstBlock: 4},
		{Src: plan.G4, SrcBlock: int64(hashes[1]), Dst: plan.G2, DstBlock: 5},
		{Src: plan.G4, SrcBlock: int64(hashes[2]), Dst: plan.G2, DstBlock: 6},
		{Src: plan.G4, SrcBlock: 0x5eed, Dst: plan.G2, DstBlock: 7}, // never stored
		{Src: plan.G2, SrcBlock: 4, Dst: plan.G1, DstBlock: g1dst[0]},
		{Src: plan.G2, SrcBlock: 5, Dst: plan.G1, DstBlock: g1dst[1]},
		{Src: plan.G2, SrcBlock: 6, Dst: plan.G1, DstBlock: g1dst[2]},
		{Src: plan.G2, SrcBlock: 7, Dst: plan.G1, DstBlock: g1dst[3]},
	}}
	before := object.Snapshot()
	loaded, failed := run(t, wb, &plan.Step{Seq: 1, Loads: []plan.Load{ld}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, []int64{32, 33}, failed, "the corrupt and the missing object fail their G1 blocks")
	require.Equal(t, want[0], gb.block(g1dst[0]))
	require.Equal(t, want[1], gb.block(g1dst[1]))
	after := object.Snapshot()
	require.Equal(t, uint64(2), after.Downloaded-before.Downloaded)
	require.Equal(t, uint64(1), after.Corrupt-before.Corrupt)
	require.Equal(t, uint64(1), after.VerifyFailures-before.VerifyFailures)
}

// TestG4ForgedObjectsNeverReachG1: a hostile server (or a writer to the
// bucket, or a man in the middle on http://) answers each GET with an
// object it built for that key from a genuine header, attacker bytes and
// recomputed checksums. Every G1 block of the load fails (the engine
// recomputes it), none holds the attacker's bytes, the failures are
// counted, and nothing is deleted.
func TestG4ForgedObjectsNeverReachG1(t *testing.T) {
	f := s3test.StartFake(t)
	fp := fingerprint.Inputs{Model: "m", DType: "bf16", BlockSize: bs, TPSize: 1}.Sum()
	ga := newG1(t, layout.FlashAttn)
	bpb := int(ga.e.BytesPerBlock())
	fakeStore := func() *object.Store {
		c, err := object.NewClient(object.ClientOptions{Host: f.Addr, Bucket: "kv-worker", Region: "us-east-1",
			AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
		require.NoError(t, err)
		require.NoError(t, c.EnsureBucket(context.Background(), "us-east-1"))
		s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp, BlockBytes: bpb,
			BreakerCooldown: 50 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(s.Close)
		return s
	}
	sa := fakeStore()
	wa := newWorker(t, ga, Options{HostBlocks: 8, G4: sa})
	hashes := []uint64{0xb1, 0xb2, 0xb3, 0xb4}
	_, failed := run(t, wa, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{1, 2, 3, 4}, plan.G2, []int64{0, 1, 2, 3}),
		Uploads: []plan.Upload{{Block: 0, Hash: hashes[0]}, {Block: 1, Hash: hashes[1], Parent: hashes[0]},
			{Block: 2, Hash: hashes[2], Parent: hashes[1]}, {Block: 3, Hash: hashes[3], Parent: hashes[2]}}})
	require.Empty(t, failed)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sa.Flush(ctx))
	keys := f.Keys("kv-worker")
	require.Len(t, keys, 4)
	tmpl, _ := f.Object("kv-worker", keys[0])

	evil := func(h uint64) []byte { return bytes.Repeat([]byte{0x66, byte(h)}, bpb/2) }
	f.OnGet(func(key string, _ []byte, _ int) s3test.Reply {
		h, err := strconv.ParseUint(path.Base(key), 16, 64)
		if err != nil { // the server's goroutine: fail, but do not stop it
			t.Errorf("object key %q: %v", key, err)
		}
		payload := evil(h)
		b := make([]byte, object.HeaderSize+len(payload))
		copy(b, tmpl[:object.HeaderSize])
		copy(b[object.HeaderSize:], payload)
		binary.LittleEndian.PutUint64(b[24:32], h)
		binary.LittleEndian.PutUint64(b[48:56], xxh3.Hash(payload))
		binary.LittleEndian.PutUint64(b[56:64], xxh3.Hash(b[:56]))
		return s3test.Reply{Body: b}
	})

	gb := newG1(t, layout.FlashAttn)
	sb := fakeStore()
	wb := newWorker(t, gb, Options{HostBlocks: 8, G4: sb})
	g1dst := []int64{20, 21, 22, 23}
	ld := plan.Load{ReqID: "r"}
	for i, h := range hashes {
		ld.Copies = append(ld.Copies, plan.Copy{Src: plan.G4, SrcBlock: int64(h), Dst: plan.G2, DstBlock: int64(4 + i)})
	}
	for i := range hashes {
		ld.Copies = append(ld.Copies, plan.Copy{Src: plan.G2, SrcBlock: int64(4 + i), Dst: plan.G1, DstBlock: g1dst[i]})
	}
	before := object.Snapshot()
	loaded, failed := run(t, wb, &plan.Step{Seq: 1, Loads: []plan.Load{ld}})
	require.Equal(t, []string{"r"}, loaded)
	require.Equal(t, g1dst, failed, "every forged block fails its G1 block")
	for i, h := range hashes {
		require.NotEqual(t, evil(h), gb.block(g1dst[i]), "the attacker's bytes reached G1 block %d", g1dst[i])
	}
	after := object.Snapshot()
	require.Zero(t, after.Downloaded-before.Downloaded)
	require.Equal(t, uint64(len(hashes)), after.VerifyFailures-before.VerifyFailures)
	require.Empty(t, f.Requests("DELETE"))
}

// TestG4UploadNeverBlocksWithoutStore: with the store down, a step with
// uploads completes (the uploads are dropped and counted, no error).
func TestG4UploadNeverBlocksWithoutStore(t *testing.T) {
	srv := s3test.Start(t)
	fp := fingerprint.Inputs{Model: "m"}.Sum()
	g := newG1(t, layout.FlashAttn)
	s := g4Store(t, srv, fp, int(g.e.BytesPerBlock()))
	w := newWorker(t, g, Options{HostBlocks: 8, G4: s})
	srv.Stop()
	before := object.Snapshot()
	for seq := uint64(1); seq <= 5; seq++ {
		var ups []plan.Upload
		for b := int64(0); b < 8; b++ {
			ups = append(ups, plan.Upload{Block: b, Hash: seq<<8 | uint64(b)})
		}
		_, failed := run(t, w, &plan.Step{Seq: seq, Saves: copies(plan.G1, []int64{0, 1, 2, 3, 4, 5, 6, 7}, plan.G2,
			[]int64{0, 1, 2, 3, 4, 5, 6, 7}), Uploads: ups})
		require.Empty(t, failed)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, s.Flush(ctx))
	after := object.Snapshot()
	require.Equal(t, uint64(40), after.Dropped-before.Dropped)
	require.Equal(t, uint64(0), after.Uploaded-before.Uploaded)
}

// TestG4SaltedKeys: a step's G4Salts make the worker store and load salted
// blocks under their salt's tag: another instance finds them with the salt
// and loads them byte-exact, and not without it.
func TestG4SaltedKeys(t *testing.T) {
	srv := s3test.Start(t)
	fp := fingerprint.Inputs{Model: "m", DType: "bf16", BlockSize: bs, TPSize: 1}.Sum()
	const salt = 0x5a17
	ga := newG1(t, layout.FlashAttn)
	bpb := int(ga.e.BytesPerBlock())
	sa := g4Store(t, srv, fp, bpb)
	wa := newWorker(t, ga, Options{HostBlocks: 4, G4: sa})
	_, failed := run(t, wa, &plan.Step{Seq: 1, Saves: copies(plan.G1, []int64{9}, plan.G2, []int64{0}),
		Uploads: []plan.Upload{{Block: 0, Hash: 0xb1}}, G4Salts: []plan.SaltRef{{Hash: 0xb1, Salt: salt}}})
	require.Empty(t, failed)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sa.Flush(ctx))

	gb := newG1(t, layout.FlashAttn)
	sb := g4Store(t, srv, fp, bpb)
	wb := newWorker(t, gb, Options{HostBlocks: 4, G4: sb})
	require.Zero(t, sb.Lookup(ctx, []uint64{0xb1}), "not under the unsalted key")
	require.Equal(t, 1, sb.LookupSalted(ctx, salt, []uint64{0xb1}))
	ld := plan.Load{ReqID: "r", Copies: []plan.Copy{
		{Src: plan.G4, SrcBlock: 0xb1, Dst: plan.G2, DstBlock: 1},
		{Src: plan.G2, SrcBlock: 1, Dst: plan.G1, DstBlock: 20},
	}}
	loaded, failed := run(t, wb, &plan.Step{Seq: 1, Loads: []plan.Load{ld}, G4Salts: []plan.SaltRef{{Hash: 0xb1, Salt: salt}}})
	require.Equal(t, []string{"r"}, loaded)
	require.Empty(t, failed)
	require.Equal(t, ga.block(9), gb.block(20))
}
