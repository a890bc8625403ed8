package object_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

const blockBytes = 4096

func fp(model string) fingerprint.Fingerprint {
	return fingerprint.Inputs{Model: model, DType: "bf16", BlockSize: 16, TPSize: 1}.Sum()
}

func newStore(t *testing.T, srv *s3test.Server, f fingerprint.Fingerprint, bucket string) *object.Store {
	t.Helper()
	c, err := object.NewClient(object.ClientOptions{Host: srv.Addr, Bucket: bucket, Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, c.EnsureBucket(ctx, "us-east-1"))
	s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: f, BlockBytes: blockBytes,
		Registry: object.NewRegistry(1000), QueueBlocks: 16, Uploads: 4,
		BreakerThreshold: 2, BreakerCooldown: 50 * time.Millisecond, RequestTimeout: 5 * time.Second})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

func block(seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, blockBytes)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func flush(t *testing.T, s *object.Store) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, s.Flush(ctx))
}

// testKey is the MAC key of the tests' stores (s3test's credentials, bucket
// "kv-test").
var testKey = integrity.ObjectKey(nil, s3test.SecretKey, "kv-test")

func TestHeaderRejectsDamage(t *testing.T) {
	f := fp("m")
	body := object.Encode(testKey, f, 7, 3, block(1))
	_, payload, err := object.Verify(body, testKey, f, 7, blockBytes)
	require.NoError(t, err)
	require.Equal(t, block(1), payload)
	for name, mut := range map[string]func([]byte) []byte{
		"payload bit": func(b []byte) []byte { b[object.HeaderSize+100] ^= 1; return b },
		"header bit":  func(b []byte) []byte { b[30] ^= 1; return b },
		"truncated":   func(b []byte) []byte { return b[:len(b)-1] },
		"short":       func(b []byte) []byte { return b[:10] },
	} {
		b := mut(bytes.Clone(body))
		_, _, err := object.Verify(b, testKey, f, 7, blockBytes)
		require.ErrorIs(t, err, object.ErrCorrupt, name)
		require.NotErrorIs(t, err, object.ErrUnauthenticated, name)
	}
	_, _, err = object.Verify(body, testKey, fp("other"), 7, blockBytes)
	require.ErrorIs(t, err, object.ErrCorrupt, "another fingerprint")
	_, _, err = object.Verify(body, testKey, f, 8, blockBytes)
	require.ErrorIs(t, err, object.ErrCorrupt, "another hash")
}

func TestRoundTripAndSharing(t *testing.T) {
	srv := s3test.Start(t)
	a := newStore(t, srv, fp("m"), "kv-shared")
	before := object.Snapshot()
	for h := uint64(1); h <= 8; h++ {
		require.True(t, a.Enqueue(h, h-1, block(h)))
	}
	flush(t, a)
	after := object.Snapshot()
	require.Equal(t, uint64(8), after.Uploaded-before.Uploaded)
	require.Equal(t, 8, a.Registry().Len())

	// A second instance (own registry) finds them through the store and
	// loads the same bytes; its own upload of the same block is a no-op.
	b := newStore(t, srv, fp("m"), "kv-shared")
	ctx := context.Background()
	require.Equal(t, 8, b.Lookup(ctx, []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}))
	h0 := object.Snapshot().Heads
	require.Equal(t, 0, b.Lookup(ctx, []uint64{99, 1, 2, 3, 4, 5, 6, 7, 8}), "the prefix stops at the first missing hash")
	require.Equal(t, uint64(1), object.Snapshot().Heads-h0, "a missing first block costs one request")
	dst := make([]byte, blockBytes)
	for h := uint64(1); h <= 8; h++ {
		require.NoError(t, b.Download(ctx, h, dst))
		require.Equal(t, block(h), dst)
	}
	s0 := object.Snapshot()
	c := newStore(t, srv, fp("m"), "kv-shared")
	require.True(t, c.Enqueue(3, 2, block(3)))
	flush(t, c)
	s1 := object.Snapshot()
	require.Equal(t, uint64(0), s1.Uploaded-s0.Uploaded)
	require.Equal(t, uint64(1), s1.AlreadyStored-s0.AlreadyStored, "the conditional PUT found the object")

	err := b.Download(ctx, 1234, dst)
	require.ErrorIs(t, err, object.ErrNotFound)
}

func TestOtherFingerprintNeverMatches(t *testing.T) {
	srv := s3test.Start(t)
	a := newStore(t, srv, fp("model-a"), "kv-test")
	require.True(t, a.Enqueue(42, 0, block(42)))
	flush(t, a)
	b := newStore(t, srv, fp("model-b"), "kv-test")
	ctx := context.Background()
	require.Equal(t, 0, b.Lookup(ctx, []uint64{42}))
	require.ErrorIs(t, b.Download(ctx, 42, make([]byte, blockBytes)), object.ErrNotFound)
}

func TestCorruptObjectNeverServed(t *testing.T) {
	srv := s3test.Start(t)
	s := newStore(t, srv, fp("m"), "kv-test")
	c, err := object.NewClient(object.ClientOptions{Host: srv.Addr, Bucket: "kv-test", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	ctx := context.Background()
	bad := object.Encode(testKey, fp("m"), 5, 0, block(5))
	bad[object.HeaderSize+7] ^= 0x40
	_, err = c.PutIfAbsent(ctx, s.Key(5), bad)
	require.NoError(t, err)
	require.Equal(t, 1, s.Lookup(ctx, []uint64{5}), "HEAD sees the object")

	before := object.Snapshot()
	dst := make([]byte, blockBytes)
	err = s.Download(ctx, 5, dst)
	require.ErrorIs(t, err, object.ErrCorrupt)
	require.True(t, strings.HasPrefix(err.Error(), "object: "), err.Error())
	require.Equal(t, 1, strings.Count(err.Error(), "object: "), "the package is named once: %s", err)
	require.Equal(t, uint64(1), object.Snapshot().Corrupt-before.Corrupt)
	require.False(t, s.Registry().Contains(5))
	ok, err := c.Head(ctx, s.Key(5))
	require.NoError(t, err)
	require.False(t, ok, "the corrupt object was deleted")
	// The block can be stored again, correctly.
	require.True(t, s.Enqueue(5, 0, block(5)))
	flush(t, s)
	require.NoError(t, s.Download(ctx, 5, dst))
	require.Equal(t, block(5), dst)
}

func TestOutageDegradesAndRecovers(t *testing.T) {
	srv := s3test.Start(t)
	s := newStore(t, srv, fp("m"), "kv-test")
	ctx := context.Background()
	require.True(t, s.Enqueue(1, 0, block(1)))
	flush(t, s)

	srv.Stop()
	before := object.Snapshot()
	// Uploads during the outage fail or are dropped, never block: Enqueue
	// returns at once whatever the store does.
	for h := uint64(100); h < 200; h++ {
		s.Enqueue(h, 0, block(h))
	}
	flush(t, s)
	require.False(t, s.Available(), "consecutive failures opened the breaker")
	mid := object.Snapshot()
	require.Greater(t, mid.Errors-before.Errors, uint64(0))
	require.Equal(t, uint64(100), mid.Dropped-before.Dropped, "every upload of the outage is counted as dropped")
	require.Equal(t, uint64(0), mid.Uploaded-before.Uploaded)
	err := s.Download(ctx, 1, make([]byte, blockBytes))
	require.Error(t, err)
	require.False(t, errors.Is(err, object.ErrCorrupt))
	require.Equal(t, 1, s.Lookup(ctx, []uint64{1, 100}), "only the registry answers")

	srv.Restart(t)
	// With no traffic at all, the store tests itself once per cool-down and
	// becomes available again.
	deadline := time.Now().Add(30 * time.Second)
	for !s.Available() {
		require.True(t, time.Now().Before(deadline), "the breaker never closed after the store came back")
		time.Sleep(10 * time.Millisecond)
	}
	// Uploads flow again without any restart of the store.
	for h := uint64(1000); ; h++ {
		require.True(t, time.Now().Before(deadline), "uploads did not resume after the store came back")
		s.Enqueue(h, 0, block(h))
		flush(t, s)
		if s.Registry().Contains(h) {
			break
		}
	}
	require.True(t, s.Available())
	dst := make([]byte, blockBytes)
	require.NoError(t, s.Download(ctx, 1, dst))
	require.Equal(t, block(1), dst)
}

func TestRegistryIsBounded(t *testing.T) {
	r := object.NewRegistry(3)
	for h := uint64(1); h <= 4; h++ {
		r.Add(h)
	}
	require.Equal(t, 3, r.Len())
	require.False(t, r.Contains(1), "the oldest hash went first")
	require.Equal(t, 3, r.PrefixLen([]uint64{2, 3, 4, 1}))
	r.Remove(3)
	require.Equal(t, 1, r.PrefixLen([]uint64{2, 3, 4}))
}

func TestQueueBoundedInBytes(t *testing.T) {
	c, err := object.NewClient(object.ClientOptions{Host: "127.0.0.1:1", Bucket: "kv-test"})
	require.NoError(t, err)
	for _, tc := range []struct{ blockBytes, want int }{
		{4096, object.DefaultQueueBlocks},
		{4 << 20, object.DefaultQueueBytes / (4<<20 + object.HeaderSize)},
		{1 << 30, 8},
	} {
		s, err := object.NewStore(object.StoreOptions{Client: c, BlockBytes: tc.blockBytes})
		require.NoError(t, err)
		require.Equal(t, tc.want, s.QueueCap(), "block of %d bytes", tc.blockBytes)
		s.Close()
	}
}
