package integrity

import (
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestObjectKeysDifferBySecretBucketAndOverride(t *testing.T) {
	a := ObjectKey(nil, "s3-secret", "bucket-a")
	require.True(t, a.Valid())
	require.True(t, a.Secret())
	mac := a.Sum(nil, []byte("key"), []byte("payload"))
	require.Len(t, mac, Size)
	require.Equal(t, mac, ObjectKey(nil, "s3-secret", "bucket-a").Sum(nil, []byte("key"), []byte("payload")),
		"the same secret and bucket give every instance the same key")
	for name, other := range map[string]Key{
		"other bucket":  ObjectKey(nil, "s3-secret", "bucket-b"),
		"other secret":  ObjectKey(nil, "s3-secret2", "bucket-a"),
		"override":      ObjectKey([]byte("0123456789abcdef"), "s3-secret", "bucket-a"),
		"anonymous":     ObjectKey(nil, "", "bucket-a"),
		"local purpose": mustLocal(t, []byte("s3-secret")),
	} {
		require.NotEqual(t, mac, other.Sum(nil, []byte("key"), []byte("payload")), name)
	}
	require.False(t, ObjectKey(nil, "", "bucket-a").Secret(), "anonymous access has no secret")
	require.False(t, Key{}.Valid())
}

func mustLocal(t *testing.T, override []byte) Key {
	k, err := LocalKey(override, t.TempDir())
	require.NoError(t, err)
	return k
}

func TestSumSeparatesFields(t *testing.T) {
	k := ObjectKey(nil, "s", "b")
	require.NotEqual(t, k.Sum(nil, []byte("ab"), []byte("c")), k.Sum(nil, []byte("a"), []byte("bc")))
	require.True(t, Equal(k.Sum(nil, []byte("x")), k.Sum(nil, []byte("x"))))
	require.False(t, Equal(k.Sum(nil, []byte("x")), k.Sum(nil, []byte("y"))))
}

func TestSecretIsCreatedOncePrivateAndShared(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cfg", "kvbm")
	var wg sync.WaitGroup
	secrets := make([][]byte, 8)
	for i := range secrets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := LoadOrCreateSecret(dir)
			require.NoError(t, err)
			secrets[i] = s
		}()
	}
	wg.Wait()
	for _, s := range secrets[1:] {
		require.Equal(t, secrets[0], s, "concurrent first starts agree on one secret")
	}
	fi, err := os.Stat(filepath.Join(dir, SecretFileName))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	di, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), di.Mode().Perm())

	k1, err := LocalKey(nil, dir)
	require.NoError(t, err)
	k2, err := LocalKey(nil, dir)
	require.NoError(t, err)
	require.Equal(t, k1.Sum(nil, []byte("b")), k2.Sum(nil, []byte("b")), "a restart finds the same key")
}

func TestUnsafeSecretsAreRefused(t *testing.T) {
	t.Run("group-writable directory", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o770))
		_, err := LoadOrCreateSecret(dir)
		require.ErrorIs(t, err, ErrUnsafe)
	})
	t.Run("symlinked directory", func(t *testing.T) {
		real := t.TempDir()
		link := filepath.Join(t.TempDir(), "link")
		require.NoError(t, os.Symlink(real, link))
		_, err := LoadOrCreateSecret(link)
		require.ErrorIs(t, err, ErrUnsafe)
	})
	t.Run("symlinked secret", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o700))
		target := filepath.Join(t.TempDir(), "planted")
		require.NoError(t, os.WriteFile(target, make([]byte, SecretSize), 0o600))
		require.NoError(t, os.Symlink(target, filepath.Join(dir, SecretFileName)))
		_, err := LoadOrCreateSecret(dir)
		require.Error(t, err)
	})
	t.Run("readable by others", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(dir, SecretFileName), make([]byte, SecretSize), 0o644))
		_, err := LoadOrCreateSecret(dir)
		require.ErrorIs(t, err, ErrUnsafe)
	})
	t.Run("wrong length", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(dir, SecretFileName), []byte("short"), 0o600))
		_, err := LoadOrCreateSecret(dir)
		require.ErrorContains(t, err, "want exactly 32 bytes")
	})
	t.Run("hard link", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, 0o700))
		other := filepath.Join(dir, "other")
		require.NoError(t, os.WriteFile(other, make([]byte, SecretSize), 0o600))
		require.NoError(t, os.Link(other, filepath.Join(dir, SecretFileName)))
		_, err := LoadOrCreateSecret(dir)
		require.ErrorIs(t, err, ErrUnsafe)
	})
}

func TestSealBindsPayloadFieldsAndKey(t *testing.T) {
	k := ObjectKey(nil, "s3-secret", "bucket")
	payload := make([]byte, 4096)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	sealed := k.Seal(nil, payload, []byte("key"), []byte("fp"))
	require.Len(t, sealed, SealSize)
	require.True(t, k.Open(sealed, payload, []byte("key"), []byte("fp")))
	require.NotEqual(t, sealed, k.Seal(nil, payload, []byte("key"), []byte("fp")), "every seal draws a fresh salt")

	flipped := append([]byte(nil), payload...)
	flipped[len(flipped)-1] ^= 1
	require.False(t, k.Open(sealed, flipped, []byte("key"), []byte("fp")), "payload")
	require.False(t, k.Open(sealed, payload, []byte("key2"), []byte("fp")), "field")
	require.False(t, k.Open(sealed, payload, []byte("ke"), []byte("yfp")), "field boundaries")
	require.False(t, k.Open(sealed, payload, []byte("key")), "missing field")
	require.False(t, k.Open(sealed, payload[:len(payload)-1], []byte("key"), []byte("fp")), "truncated payload")
	require.False(t, ObjectKey(nil, "other", "bucket").Open(sealed, payload, []byte("key"), []byte("fp")), "key")
	bad := append([]byte(nil), sealed...)
	bad[0] ^= 1
	require.False(t, k.Open(bad, payload, []byte("key"), []byte("fp")), "salt")
	bad = append([]byte(nil), sealed...)
	bad[SealSize-1] ^= 1
	require.False(t, k.Open(bad, payload, []byte("key"), []byte("fp")), "tag")
	require.False(t, k.Open(sealed[:SealSize-1], payload, []byte("key"), []byte("fp")), "short")
	require.False(t, Key{}.Open(sealed, payload, []byte("key"), []byte("fp")), "zero key")
	// Sum and Seal never share a key: a Sum over the same fields is no seal.
	require.False(t, k.Open(k.Sum(nil, []byte("key"), []byte("fp"), payload), payload, []byte("key"), []byte("fp")))
}

func BenchmarkPayloadMAC(b *testing.B) {
	k := ObjectKey(nil, "s3-secret", "bucket")
	payload := make([]byte, 2<<20)
	b.Run("Sum (HMAC-SHA256)", func(b *testing.B) {
		b.SetBytes(int64(len(payload)))
		for b.Loop() {
			k.Sum(nil, []byte("key"), payload)
		}
	})
	b.Run("Seal (one-time-key GMAC)", func(b *testing.B) {
		b.SetBytes(int64(len(payload)))
		for b.Loop() {
			k.Seal(nil, payload, []byte("key"))
		}
	})
}
