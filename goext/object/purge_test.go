package object_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

func listKeys(t *testing.T, srv *s3test.Server, bucket string) []string {
	t.Helper()
	mc, err := minio.New(srv.Addr, &minio.Options{Creds: credentials.NewStaticV4(s3test.AccessKey, s3test.SecretKey, "")})
	require.NoError(t, err)
	var keys []string
	for o := range mc.ListObjects(context.Background(), bucket, minio.ListObjectsOptions{Recursive: true}) {
		require.NoError(t, o.Err)
		keys = append(keys, o.Key)
	}
	return keys
}

// TestPurgeSaltAcrossRanks (versitygw): salted blocks lie under their
// salt's tag prefix for every fingerprint (here two tensor-parallel
// ranks), a purge of the salt deletes exactly them with one listing of
// that prefix, and other salts' and unsalted objects still download.
func TestPurgeSaltAcrossRanks(t *testing.T) {
	srv := s3test.Start(t)
	a := hashing.SaltHash("tenant-a", true, "", false)
	b := hashing.SaltHash("tenant-b", true, "", false)
	rank0 := newStore(t, srv, fingerprint.Inputs{Model: "m", TPSize: 2, Rank: 0}.Sum(), "kv-test")
	rank1 := newStore(t, srv, fingerprint.Inputs{Model: "m", TPSize: 2, Rank: 1}.Sum(), "kv-test")
	for h := uint64(1); h <= 5; h++ {
		for _, s := range []*object.Store{rank0, rank1} {
			require.True(t, s.EnqueueSalted(a, h, h-1, block(h)))
			require.True(t, s.EnqueueSalted(b, h+100, h+99, block(h+100)))
		}
		require.True(t, rank0.Enqueue(h+200, h+199, block(h+200)))
		flush(t, rank0) // the test stores queue 16
	}
	flush(t, rank0)
	flush(t, rank1)
	tagA := rank0.SaltTag(a)
	require.Len(t, tagA, 16)
	require.Equal(t, tagA, rank1.SaltTag(a), "the tag depends on the key, not the rank")
	require.NotEqual(t, tagA, rank0.SaltTag(b))
	require.Empty(t, rank0.SaltTag(hashing.DefaultSaltHash))
	require.Equal(t, rank0.Key(201), rank0.KeyFor(hashing.DefaultSaltHash, 201), "unsalted keys are unchanged")
	require.Len(t, listKeys(t, srv, "kv-test"), 25)

	res, err := rank0.PurgeSalt(context.Background(), a)
	require.NoError(t, err)
	require.Equal(t, object.PurgeResult{Listed: 10, Deleted: 10}, res, "both ranks' objects of salt A, nothing else listed")
	keys := listKeys(t, srv, "kv-test")
	require.Len(t, keys, 15)
	for _, k := range keys {
		require.False(t, strings.HasPrefix(k, rank0.SaltPrefix(a)), k)
	}
	require.False(t, rank0.Registry().Contains(3), "purged hashes leave the registry")
	dst := make([]byte, blockBytes)
	require.ErrorIs(t, rank0.DownloadSalted(context.Background(), a, 3, dst), object.ErrNotFound)
	require.NoError(t, rank0.DownloadSalted(context.Background(), b, 103, dst))
	require.Equal(t, block(103), dst)
	require.NoError(t, rank0.Download(context.Background(), 203, dst))
	require.Equal(t, 0, rank0.LookupSalted(context.Background(), a, []uint64{1, 2}))
	require.Equal(t, 2, rank1.LookupSalted(context.Background(), b, []uint64{101, 102}))

	_, err = rank0.PurgeSalt(context.Background(), hashing.DefaultSaltHash)
	require.ErrorContains(t, err, "object: purge of the default salt")
	_, err = rank0.PurgeAll(context.Background(), false)
	require.ErrorIs(t, err, object.ErrPurgeAll)
	res, err = rank0.PurgeAll(context.Background(), true)
	require.NoError(t, err)
	require.Equal(t, 15, res.Deleted)
	require.Empty(t, listKeys(t, srv, "kv-test"))
}

// TestSweepBounded (versitygw): each expiry pass lists at most its bound,
// resumes where the last one stopped, wraps around at the end, and deletes
// only objects older than the TTL.
func TestSweepBounded(t *testing.T) {
	srv := s3test.Start(t)
	s := newStore(t, srv, fp("m"), "kv-test")
	for h := uint64(1); h <= 25; h++ {
		require.True(t, s.Enqueue(h, 0, block(h)))
		if h%8 == 0 {
			flush(t, s) // the test store queues 16
		}
	}
	flush(t, s)
	ctx := context.Background()
	next, res, err := s.Sweep(ctx, time.Now(), time.Hour, 10, "")
	require.NoError(t, err)
	require.Equal(t, object.PurgeResult{Listed: 10}, res, "nothing is an hour old")
	require.NotEmpty(t, next)

	later := time.Now().Add(2 * time.Hour)
	cursor := ""
	var listed []int
	for pass := 0; pass < 3; pass++ {
		cursor, res, err = s.Sweep(ctx, later, time.Hour, 10, cursor)
		require.NoError(t, err)
		require.Equal(t, res.Listed, res.Deleted)
		listed = append(listed, res.Listed)
	}
	require.Equal(t, []int{10, 10, 5}, listed)
	require.Empty(t, cursor, "the listing reached the end: the next pass starts over")
	require.Empty(t, listKeys(t, srv, "kv-test"))
	_, _, err = s.Sweep(ctx, later, 0, 10, "")
	require.ErrorContains(t, err, "object: sweep")
}

// TestPurgeHashesAcrossRanks (versitygw): a prefix purge from rank 0's
// store deletes the named blocks of every tensor-parallel rank, salted and
// unsalted, and nothing else: other blocks of both ranks, and the same
// hashes under another salt, still download.
func TestPurgeHashesAcrossRanks(t *testing.T) {
	srv := s3test.Start(t)
	a := hashing.SaltHash("tenant-a", true, "", false)
	b := hashing.SaltHash("tenant-b", true, "", false)
	fp0 := fingerprint.Inputs{Model: "m", TPSize: 2, Rank: 0}.Sum()
	fp1 := fingerprint.Inputs{Model: "m", TPSize: 2, Rank: 1}.Sum()
	rank0 := newStore(t, srv, fp0, "kv-test")
	rank1 := newStore(t, srv, fp1, "kv-test")
	// The same hashes under three salts. An engine never makes them (the
	// salt seeds the sequence hash, and a store's registry of stored
	// hashes is salt-blind), so each salt's copies are uploaded by a store
	// of its own: one registry would skip the second salt's upload of a
	// hash whose first upload finished before it started.
	for _, f := range []fingerprint.Fingerprint{fp0, fp1} {
		for _, salt := range []uint64{0, a, b} {
			up := newStore(t, srv, f, "kv-test")
			for h := uint64(1); h <= 4; h++ {
				require.True(t, up.EnqueueSalted(salt, h, h-1, block(h)))
			}
			flush(t, up)
		}
	}
	require.Len(t, listKeys(t, srv, "kv-test"), 24)
	ctx := context.Background()
	dst := make([]byte, blockBytes)

	res, err := rank0.PurgeHashes(ctx, hashing.DefaultSaltHash, []uint64{2, 3})
	require.NoError(t, err)
	require.Equal(t, object.PurgeResult{Listed: 4, Deleted: 4}, res, "blocks 2 and 3 of both ranks")
	for _, s := range []*object.Store{rank0, rank1} {
		require.ErrorIs(t, s.Download(ctx, 2, dst), object.ErrNotFound)
		require.ErrorIs(t, s.Download(ctx, 3, dst), object.ErrNotFound)
		require.NoError(t, s.Download(ctx, 1, dst))
		require.NoError(t, s.DownloadSalted(ctx, a, 2, dst), "salted copies are another prefix")
	}
	require.Len(t, listKeys(t, srv, "kv-test"), 20)

	res, err = rank0.PurgeHashes(ctx, a, []uint64{4})
	require.NoError(t, err)
	require.Equal(t, object.PurgeResult{Listed: 2, Deleted: 2}, res)
	for _, s := range []*object.Store{rank0, rank1} {
		require.ErrorIs(t, s.DownloadSalted(ctx, a, 4, dst), object.ErrNotFound)
		require.NoError(t, s.DownloadSalted(ctx, b, 4, dst), "salt B keeps block 4")
		require.NoError(t, s.Download(ctx, 4, dst))
	}
	require.Len(t, listKeys(t, srv, "kv-test"), 18)

	// A salt nobody stored: only rank 0's own keys are named.
	res, err = rank0.PurgeHashes(ctx, hashing.SaltHash("nobody", true, "", false), []uint64{1})
	require.NoError(t, err)
	require.Equal(t, 1, res.Listed)
	require.Len(t, listKeys(t, srv, "kv-test"), 18)
}
