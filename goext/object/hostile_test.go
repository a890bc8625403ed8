package object_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"log/slog"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

// Tests against s3test.Fake: an in-memory S3 server playing hostile or
// flaky, so they need no external binary.

const fakeBucket = "kv-fake"

// syncBuf is a log sink safe for the store's goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func fakeClient(t *testing.T, f *s3test.Fake, secret string) *object.Client {
	t.Helper()
	o := object.ClientOptions{Host: f.Addr, Bucket: fakeBucket, Region: "us-east-1"}
	if secret != "" {
		o.AccessKey, o.SecretKey = s3test.AccessKey, secret
	}
	c, err := object.NewClient(o)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, c.EnsureBucket(ctx, "us-east-1"))
	return c
}

// fakeStore is an instance on f with its own registry; its log goes to logs
// (nil: discarded). The clock stands still, so the rate-limited warnings
// show at most once.
func fakeStore(t *testing.T, f *s3test.Fake, logs *syncBuf) *object.Store {
	t.Helper()
	log := slog.New(slog.DiscardHandler)
	if logs != nil {
		log = slog.New(slog.NewTextHandler(logs, nil))
	}
	now := time.Unix(1_800_000_000, 0)
	s, err := object.NewStore(object.StoreOptions{Client: fakeClient(t, f, s3test.SecretKey), Fingerprint: fp("m"),
		BlockBytes: blockBytes, Registry: object.NewRegistry(1000), QueueBlocks: 16, Uploads: 4,
		BreakerThreshold: 100, BreakerCooldown: time.Hour, RequestTimeout: 5 * time.Second, Logger: log,
		Now: func() time.Time { return now }})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

// seqOf is the sequence hash an object key names (its last element). It
// runs in the server's goroutines, where a test may fail but not stop.
func seqOf(t *testing.T, key string) uint64 {
	h, err := strconv.ParseUint(path.Base(key), 16, 64)
	if err != nil {
		t.Errorf("object key %q: %v", key, err)
	}
	return h
}

// forge builds what a writer without the key can: a genuine object's
// header (template) reused for sequence hash seq and payload, with every
// checksum recomputed.
func forge(template []byte, seq uint64, payload []byte) []byte {
	b := make([]byte, object.HeaderSize+len(payload))
	copy(b, template[:object.HeaderSize])
	copy(b[object.HeaderSize:], payload)
	binary.LittleEndian.PutUint64(b[24:32], seq)
	binary.LittleEndian.PutUint64(b[40:48], uint64(len(payload)))
	binary.LittleEndian.PutUint64(b[48:56], xxh3.Hash(payload))
	binary.LittleEndian.PutUint64(b[56:64], xxh3.Hash(b[:56]))
	return b
}

func attackerBytes(seq uint64) []byte { return bytes.Repeat([]byte{0xA7, byte(seq)}, blockBytes/2) }

// upload stores hashes 1..n through a genuine instance and returns one of
// the stored objects (a template for forgeries).
func upload(t *testing.T, f *s3test.Fake, n uint64) []byte {
	t.Helper()
	a := fakeStore(t, f, nil)
	for h := uint64(1); h <= n; h++ {
		require.True(t, a.Enqueue(h, h-1, block(h)))
	}
	flush(t, a)
	keys := f.Keys(fakeBucket)
	require.Len(t, keys, int(n))
	tmpl, _ := f.Object(fakeBucket, keys[0])
	return tmpl
}

// A hostile server (or a writer to the bucket, or a man in the middle on
// http://) answers every key kvbm asks for with an object it built itself:
// a genuine header reused, attacker bytes, checksums recomputed. None of it
// is served: every download is a miss, counted, and nothing is deleted.
func TestForgedObjectsAreMisses(t *testing.T) {
	f := s3test.StartFake(t)
	tmpl := upload(t, f, 4)
	f.OnHead(func(string, bool) bool { return true })
	f.OnGet(func(key string, _ []byte, _ int) s3test.Reply {
		return s3test.Reply{Body: forge(tmpl, seqOf(t, key), attackerBytes(seqOf(t, key)))}
	})

	var logs syncBuf
	b := fakeStore(t, f, &logs)
	ctx := context.Background()
	hashes := []uint64{1, 2, 3, 4, 100, 101} // stored, and never stored
	require.Equal(t, len(hashes), b.Lookup(ctx, hashes), "the server claims them all")
	before := object.Snapshot()
	dst := make([]byte, blockBytes)
	for _, h := range hashes {
		err := b.Download(ctx, h, dst)
		require.ErrorIs(t, err, object.ErrCorrupt, "hash %d", h)
		require.ErrorIs(t, err, object.ErrUnauthenticated, "hash %d", h)
		require.False(t, b.Registry().Contains(h), "hash %d stays in the registry", h)
	}
	after := object.Snapshot()
	require.Zero(t, after.Downloaded-before.Downloaded, "a forged object was served")
	require.Equal(t, uint64(len(hashes)), after.VerifyFailures-before.VerifyFailures)
	require.Zero(t, after.Corrupt-before.Corrupt)
	require.Empty(t, f.Requests(http.MethodDelete), "intact bytes under another key prove no damage")
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN"), "warnings are rate-limited:\n%s", logs.String())
	require.Contains(t, logs.String(), config.EnvStorageSecret)

	// Knowing the format and the keyless derivation (the bucket's name) does
	// not help the forger either: the key derives from the S3 secret.
	guess := integrity.ObjectKey(nil, "", fakeBucket)
	f.OnGet(func(key string, _ []byte, _ int) s3test.Reply {
		h := seqOf(t, key)
		body := forge(tmpl, h, attackerBytes(h))
		guess.Sum(body[64:64:object.HeaderSize], []byte(object.Key(fp("m"), h)), body[:56], body[object.HeaderSize:])
		return s3test.Reply{Body: body}
	})
	require.ErrorIs(t, b.Download(ctx, 1, dst), object.ErrUnauthenticated)
}

// A flaky server or proxy: failed requests, bodies cut short, wrong bytes
// once, different wrong bytes on each read. Each download is a miss, and no
// DELETE ever reaches the server: the objects are fine for every instance.
func TestFlakyServerNeverDeletes(t *testing.T) {
	f := s3test.StartFake(t)
	upload(t, f, 8)
	b := fakeStore(t, f, nil)
	ctx := context.Background()
	dst := make([]byte, blockBytes)
	type replyFn = func(stored []byte, nth int) s3test.Reply
	flip := func(b []byte, at int) []byte { b = bytes.Clone(b); b[at] ^= 0x10; return b }
	for i, tc := range []struct {
		name  string
		reply replyFn
		bad   bool // the bytes read do not verify (else: a transport error)
	}{
		{"500 on every read", func([]byte, int) s3test.Reply { return s3test.Reply{Status: 500} }, false},
		{"503 once", func(s []byte, n int) s3test.Reply {
			if n == 1 {
				return s3test.Reply{Status: 503}
			}
			return s3test.Reply{Body: s}
		}, false},
		{"body cut short", func(s []byte, _ int) s3test.Reply { return s3test.Reply{Body: s, Cut: len(s) / 2} }, false},
		{"wrong payload byte once", func(s []byte, n int) s3test.Reply {
			if n == 1 {
				return s3test.Reply{Body: flip(s, object.HeaderSize+9)}
			}
			return s3test.Reply{Body: s}
		}, true},
		{"different wrong bytes on each read", func(s []byte, n int) s3test.Reply {
			return s3test.Reply{Body: flip(s, object.HeaderSize+n)}
		}, true},
		{"wrong header byte, then cut short", func(s []byte, n int) s3test.Reply {
			if n == 1 {
				return s3test.Reply{Body: flip(s, 30)}
			}
			return s3test.Reply{Body: s, Cut: 100}
		}, true},
		{"extra bytes once", func(s []byte, n int) s3test.Reply {
			if n == 1 {
				return s3test.Reply{Body: append(bytes.Clone(s), 0)}
			}
			return s3test.Reply{Body: s}
		}, true},
		{"short body once, length declared to match", func(s []byte, n int) s3test.Reply {
			if n == 1 {
				return s3test.Reply{Body: s[:len(s)-5]}
			}
			return s3test.Reply{Body: s}
		}, true},
	} {
		h := uint64(i + 1)
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			gets := 0
			f.OnGet(func(key string, stored []byte, _ int) s3test.Reply {
				mu.Lock()
				defer mu.Unlock()
				gets++
				if seqOf(t, key) != h {
					return s3test.Reply{Body: stored}
				}
				return tc.reply(stored, gets)
			})
			b.Registry().Add(h)
			before := object.Snapshot()
			err := b.Download(ctx, h, dst)
			require.Error(t, err)
			if tc.bad {
				require.ErrorIs(t, err, object.ErrCorrupt)
				require.Equal(t, uint64(1), object.Snapshot().VerifyFailures-before.VerifyFailures)
			} else {
				require.NotErrorIs(t, err, object.ErrCorrupt)
				require.Equal(t, uint64(1), object.Snapshot().Errors-before.Errors)
			}
			require.Zero(t, object.Snapshot().Corrupt-before.Corrupt)
			require.False(t, b.Registry().Contains(h), "a failed download drops the local entry")
			require.Empty(t, f.Requests(http.MethodDelete))
			_, ok := f.Object(fakeBucket, object.Key(fp("m"), h))
			require.True(t, ok, "the object is still stored")
			// The server behaving again, the object serves.
			f.OnGet(nil)
			require.NoError(t, b.Download(ctx, h, dst))
			require.Equal(t, block(h), dst)
		})
	}
	require.Empty(t, f.Requests(http.MethodDelete))
}

// An object damaged where it is stored (the same wrong bytes on two reads,
// no transport error) is deleted, so the block can be stored again.
func TestDamagedObjectDeletedOnceConfirmed(t *testing.T) {
	f := s3test.StartFake(t)
	upload(t, f, 2)
	b := fakeStore(t, f, nil)
	ctx := context.Background()
	for i, damage := range []func([]byte){
		func(o []byte) { o[object.HeaderSize+3] ^= 0x01 }, // payload
		func(o []byte) { o[33] ^= 0x01 },                  // header (the parent)
	} {
		h := uint64(i + 1)
		key := object.Key(fp("m"), h)
		gets := len(f.Requests(http.MethodGet))
		f.Mutate(fakeBucket, key, damage)
		before := object.Snapshot()
		err := b.Download(ctx, h, make([]byte, blockBytes))
		require.ErrorIs(t, err, object.ErrCorrupt)
		require.NotErrorIs(t, err, object.ErrUnauthenticated)
		after := object.Snapshot()
		require.Equal(t, uint64(1), after.VerifyFailures-before.VerifyFailures)
		require.Equal(t, uint64(1), after.Corrupt-before.Corrupt)
		require.Equal(t, gets+2, len(f.Requests(http.MethodGet)), "read twice")
		require.Equal(t, []string{"DELETE " + fakeBucket + "/" + key}, f.Requests(http.MethodDelete)[i:])
		_, ok := f.Object(fakeBucket, key)
		require.False(t, ok, "deleted")

		require.True(t, b.Enqueue(h, h-1, block(h)))
		flush(t, b)
		dst := make([]byte, blockBytes)
		require.NoError(t, b.Download(ctx, h, dst))
		require.Equal(t, block(h), dst)
	}
}

// Objects of the format before the MAC are misses: under their old keys
// never asked for, and under a current key not an error either.
func TestOldFormatIsAMiss(t *testing.T) {
	f := s3test.StartFake(t)
	b := fakeStore(t, f, nil)
	ctx := context.Background()
	c := fakeClient(t, f, s3test.SecretKey)
	v1 := make([]byte, 64+blockBytes)
	copy(v1, "KVBMG4v1")
	f8 := fp("m")
	copy(v1[8:24], f8[:])
	binary.LittleEndian.PutUint64(v1[24:32], 9)
	binary.LittleEndian.PutUint64(v1[40:48], blockBytes)
	binary.LittleEndian.PutUint64(v1[48:56], xxh3.Hash(v1[64:]))
	binary.LittleEndian.PutUint64(v1[56:64], xxh3.Hash(v1[:56]))
	_, err := c.PutIfAbsent(ctx, f8.String()+"/0000000000000009", v1) // the old key
	require.NoError(t, err)
	require.Equal(t, 0, b.Lookup(ctx, []uint64{9}))
	require.ErrorIs(t, b.Download(ctx, 9, make([]byte, blockBytes)), object.ErrNotFound)

	_, err = c.PutIfAbsent(ctx, b.Key(9), v1)
	require.NoError(t, err)
	before := object.Snapshot()
	err = b.Download(ctx, 9, make([]byte, blockBytes))
	require.ErrorIs(t, err, object.ErrOldFormat)
	require.ErrorIs(t, err, object.ErrNotFound)
	require.Equal(t, before.VerifyFailures, object.Snapshot().VerifyFailures)
	require.Empty(t, f.Requests(http.MethodDelete))
}

// The MAC binds the payload to the key, fingerprint, sequence hash and
// parent: moving any of them with checksums recomputed does not verify.
func TestMACCoversEveryField(t *testing.T) {
	f := fp("m")
	body := object.Encode(testKey, f, 7, 3, block(1))
	other := object.Encode(testKey, f, 8, 7, block(2))
	reseal := func(b []byte) []byte {
		binary.LittleEndian.PutUint64(b[48:56], xxh3.Hash(b[object.HeaderSize:]))
		binary.LittleEndian.PutUint64(b[56:64], xxh3.Hash(b[:56]))
		return b
	}
	for name, b := range map[string][]byte{
		"parent":          reseal(func() []byte { b := bytes.Clone(body); b[32] ^= 1; return b }()),
		"payload swapped": reseal(append(bytes.Clone(body[:object.HeaderSize]), block(2)...)),
		"sequence hash":   reseal(func() []byte { b := bytes.Clone(other); binary.LittleEndian.PutUint64(b[24:32], 7); return b }()),
		"mac bit":         func() []byte { b := bytes.Clone(body); b[70] ^= 1; return b }(),
	} {
		_, _, err := object.Verify(b, testKey, f, 7, blockBytes)
		require.ErrorIs(t, err, object.ErrUnauthenticated, name)
	}
	_, _, err := object.Verify(body, integrity.ObjectKey(nil, "another secret", "kv-test"), f, 7, blockBytes)
	require.ErrorIs(t, err, object.ErrUnauthenticated, "another key")
	_, _, err = object.Verify(body, integrity.ObjectKey(nil, s3test.SecretKey, "another-bucket"), f, 7, blockBytes)
	require.ErrorIs(t, err, object.ErrUnauthenticated, "another bucket")
	_, payload, err := object.Verify(body, testKey, f, 7, blockBytes)
	require.NoError(t, err)
	require.Equal(t, block(1), payload)
}

// With anonymous access and no DYN_KVBM_STORAGE_SECRET the key is no
// secret: one warning per process, naming the variable.
func TestAnonymousKeyWarnsOnce(t *testing.T) {
	f := s3test.StartFake(t)
	object.ResetKeyWarning()
	var logs syncBuf
	open := func(c *object.Client, key integrity.Key) {
		s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp("m"), BlockBytes: blockBytes,
			Key: key, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		require.NoError(t, err)
		s.Close()
	}
	open(fakeClient(t, f, s3test.SecretKey), integrity.Key{})
	open(fakeClient(t, f, ""), integrity.ObjectKey([]byte("0123456789abcdef-override"), "", fakeBucket))
	require.Empty(t, logs.String(), "a secret key (the S3 secret, or an override) needs no warning")
	anon := fakeClient(t, f, "")
	open(anon, integrity.Key{})
	open(anon, integrity.Key{})
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN"), logs.String())
	require.Contains(t, logs.String(), config.EnvStorageSecret)
	require.Contains(t, logs.String(), "only checksummed")
}

var _ = fingerprint.Fingerprint{}
