// Package integrity keys the MACs that authenticate stored KV: the objects of
// the shared object tier (G4) and the blocks of the persistent disk tier (G3).
//
// A checksum (XXH3) detects damage but not forgery: anyone who can write a
// block (a writer to the bucket, a server or proxy on an http:// endpoint,
// another user who planted a tier file in a shared directory) can recompute
// it. A MAC under a key the forger does not hold cannot be recomputed, so a
// block that verifies was written by a holder of the key, for the key,
// fingerprint, sequence hash and parent it claims.
//
// Two MACs, both from Go's standard library:
//   - Sum: HMAC-SHA256, for small data (headers, identities). About
//     1.7 GB/s per core with SHA-NI, so it would cost a persistent G3 write
//     three quarters of its throughput if it covered payloads.
//   - Seal / Open, for payloads (a block's KV, megabytes): GMAC under a key
//     used once. Each Seal draws a random 128-bit salt, derives a one-time
//     AES-256 key from it and the identifying fields (HMAC-SHA256 under the
//     Key: a PRF), and authenticates the payload with GCM's GHASH under that
//     key (about 11 GB/s per core with AES-NI and carry-less multiply). The
//     salt and the 128-bit tag are stored (SealSize bytes). A one-time key
//     makes GMAC's nonce-reuse weakness moot: two payloads share a key only
//     if two Seals draw the same salt (birthday bound 2^64 seals), and a
//     forger who changes a field or the salt gets an unrelated key. A keyed
//     BLAKE3 (3.6 GB/s here) would need a dependency and still be 3x slower.
//
// Keys, without a new mandatory setting:
//   - G4: HKDF-SHA256 from the S3 secret key and the bucket, which every
//     instance of a fleet sharing the bucket already holds (ObjectKey). With
//     anonymous access there is no secret: the key then only detects damage,
//     and Key.Secret reports false so the caller can warn.
//   - G3: HKDF-SHA256 from a 32-byte per-user secret that kvbm creates once
//     in a private directory of its own (LocalKey, LoadOrCreateSecret).
//   - DYN_KVBM_STORAGE_SECRET (or DYN_KVBM_STORAGE_SECRET_FILE) overrides the
//     source of both; the two tiers still get different keys (HKDF info).
//
// What the MAC does not protect against: a holder of the key (any instance
// of the fleet, or the user owning the secret) can write valid blocks, and a
// writer can replay a valid block under the same key (the same block
// stored again, which is harmless: the payload is the KV of that key).
package integrity

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// Size is the length of a MAC in bytes.
const Size = sha256.Size

// SealSize is the length of what Seal appends: the salt, then the tag.
const SealSize = sealSaltSize + sealTagSize

const (
	sealSaltSize = 16
	sealTagSize  = 16
)

// SecretSize is the length of the per-user secret kvbm creates.
const SecretSize = 32

// MinOverrideSize is the shortest DYN_KVBM_STORAGE_SECRET accepted.
const MinOverrideSize = 16

// SecretFileName is the per-user secret's name inside its directory.
const SecretFileName = "storage-secret"

// HKDF info strings: one per use, so a key never serves two purposes.
const (
	infoObject = "kvbm g4 object mac v1"
	infoLocal  = "kvbm g3 block mac v1"
)

// Key is a MAC key. The zero Key is not valid (Valid reports false).
type Key struct {
	k      [32]byte
	seal   [32]byte // derives Seal's one-time keys (from k; never used by Sum)
	valid  bool
	secret bool
	source string
}

// Valid reports whether k was derived (the zero Key is not).
func (k Key) Valid() bool { return k.valid }

// Secret reports whether k derives from a secret (false for a G4 key of
// anonymous access without an override: it then detects damage only).
func (k Key) Secret() bool { return k.secret }

// Source says where the key came from, for start-up logs (never the key).
func (k Key) Source() string { return k.source }

// New returns an HMAC-SHA256 under k, for MACs over streamed data.
func (k Key) New() hash.Hash { return hmac.New(sha256.New, k.k[:]) }

// Sum appends to dst the MAC of fields, each prefixed by its length (so
// that ("ab","c") and ("a","bc") differ).
func (k Key) Sum(dst []byte, fields ...[]byte) []byte {
	m := k.New()
	var l [8]byte
	for _, f := range fields {
		binary.LittleEndian.PutUint64(l[:], uint64(len(f)))
		m.Write(l[:])
		m.Write(f)
	}
	return m.Sum(dst)
}

// Seal appends to dst a random salt and the MAC of payload under a
// one-time key derived from the salt and fields (see the package comment).
// Open checks it. fields identify the payload (key, fingerprint, sequence
// hash...); they are not stored by Seal.
func (k Key) Seal(dst, payload []byte, fields ...[]byte) []byte {
	var salt [sealSaltSize]byte
	if _, err := rand.Read(salt[:]); err != nil { // never fails on Linux (getrandom)
		panic("integrity: random salt: " + err.Error())
	}
	dst = append(dst, salt[:]...)
	return k.sealTag(dst, salt[:], payload, fields)
}

// Open reports whether sealed (SealSize bytes from Seal) is the MAC of
// payload under fields and k.
func (k Key) Open(sealed, payload []byte, fields ...[]byte) bool {
	if len(sealed) != SealSize || !k.valid {
		return false
	}
	var tag [sealTagSize]byte
	return hmac.Equal(k.sealTag(tag[:0], sealed[:sealSaltSize], payload, fields), sealed[sealSaltSize:])
}

var zeroNonce [12]byte

func (k Key) sealTag(dst, salt, payload []byte, fields [][]byte) []byte {
	m := hmac.New(sha256.New, k.seal[:])
	m.Write(salt)
	var l [8]byte
	for _, f := range fields {
		binary.LittleEndian.PutUint64(l[:], uint64(len(f)))
		m.Write(l[:])
		m.Write(f)
	}
	var once [32]byte
	block, err := aes.NewCipher(m.Sum(once[:0]))
	if err != nil { // only for a key length other than 16, 24 or 32
		panic("integrity: " + err.Error())
	}
	gcm, err := cipher.NewGCMWithTagSize(block, sealTagSize)
	if err != nil {
		panic("integrity: " + err.Error())
	}
	// GMAC: nothing encrypted, payload authenticated. The nonce may be
	// fixed: the key is used for this payload only.
	return gcm.Seal(dst, zeroNonce[:], nil, payload)
}

// Equal compares two MACs in constant time.
func Equal(a, b []byte) bool { return hmac.Equal(a, b) }

// newKey makes a valid Key from derived key material.
func newKey(k [32]byte, secret bool, source string) Key {
	return Key{k: k, seal: derive(k[:], "", "kvbm seal key v1"), valid: true, secret: secret, source: source}
}

func derive(secret []byte, salt, info string) [32]byte {
	out, err := hkdf.Key(sha256.New, secret, []byte(salt), info, 32)
	if err != nil { // only for lengths past 255*32 bytes
		panic("integrity: " + err.Error())
	}
	var k [32]byte
	copy(k[:], out)
	return k
}

// ObjectKey derives the G4 key: from override when it is set, else from the
// S3 secret key, salted by the bucket (so two buckets never share a key).
func ObjectKey(override []byte, s3Secret, bucket string) Key {
	switch {
	case len(override) > 0:
		return newKey(derive(override, bucket, infoObject), true, "DYN_KVBM_STORAGE_SECRET")
	case s3Secret != "":
		return newKey(derive([]byte(s3Secret), bucket, infoObject), true, "the S3 secret key and bucket")
	default:
		return newKey(derive(nil, bucket, infoObject), false,
			"the bucket name only (anonymous access: detects damage, not forgery)")
	}
}

// LocalKey derives the G3 key: from override when it is set, else from the
// per-user secret in dir (created on first use, see LoadOrCreateSecret).
func LocalKey(override []byte, dir string) (Key, error) {
	if len(override) > 0 {
		return newKey(derive(override, "", infoLocal), true, "DYN_KVBM_STORAGE_SECRET"), nil
	}
	s, err := LoadOrCreateSecret(dir)
	if err != nil {
		return Key{}, err
	}
	return newKey(derive(s, "", infoLocal), true, filepath.Join(dir, SecretFileName)), nil
}

// ErrUnsafe is wrapped by errors about a directory or file that another user
// could have written.
var ErrUnsafe = errors.New("integrity: unsafe file or directory")

// PrivateDir creates dir (mode 0700, parents 0700 as needed) or checks an
// existing one: a directory (not a symlink), owned by this user, with no
// group or other permissions.
func PrivateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("integrity: create %s: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("integrity: %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is not a directory (a symlink is refused)", ErrUnsafe, dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: %s belongs to uid %d, not this user (uid %d)", ErrUnsafe, dir, st.Uid, os.Geteuid())
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("%w: %s has mode %v; kvbm needs it private to this user (chmod 700)",
			ErrUnsafe, dir, fi.Mode().Perm())
	}
	return nil
}

// CheckOwnFile checks an open file: a regular file with one link, owned by
// this user, not writable by group or others.
func CheckOwnFile(f *os.File) error {
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("integrity: %s: %w", f.Name(), err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%w: %s is not a regular file", ErrUnsafe, f.Name())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		if int(st.Uid) != os.Geteuid() {
			return fmt.Errorf("%w: %s belongs to uid %d, not this user (uid %d)", ErrUnsafe, f.Name(), st.Uid, os.Geteuid())
		}
		if st.Nlink != 1 {
			return fmt.Errorf("%w: %s has %d links (a hard link to another file is refused)", ErrUnsafe, f.Name(), st.Nlink)
		}
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%w: %s has mode %v: writable by group or others", ErrUnsafe, f.Name(), fi.Mode().Perm())
	}
	return nil
}

// LoadOrCreateSecret returns the per-user secret in dir, creating dir
// (private) and the secret (0600, SecretSize random bytes) on first use.
// The directory is locked (flock) while the secret is read or created, so
// concurrent first starts agree on one secret and never read a partial one.
func LoadOrCreateSecret(dir string) ([]byte, error) {
	if err := PrivateDir(dir); err != nil {
		return nil, err
	}
	d, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("integrity: open %s: %w", dir, err)
	}
	defer d.Close()
	if err := syscall.Flock(int(d.Fd()), syscall.LOCK_EX); err != nil {
		return nil, fmt.Errorf("integrity: lock %s: %w", dir, err)
	}
	defer syscall.Flock(int(d.Fd()), syscall.LOCK_UN) //nolint:errcheck // closing the descriptor unlocks too
	path := filepath.Join(dir, SecretFileName)
	if s, err := readSecret(path); err == nil || !errors.Is(err, os.ErrNotExist) {
		return s, err
	}
	s := make([]byte, SecretSize)
	if _, err := rand.Read(s); err != nil {
		return nil, fmt.Errorf("integrity: random secret: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("integrity: create secret %s: %w", path, err)
	}
	if _, err = f.Write(s); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("integrity: write secret %s: %w", path, err)
	}
	return s, nil
}

func readSecret(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("integrity: open secret %s: %w", path, err)
	}
	defer f.Close()
	if err := CheckOwnFile(f); err != nil {
		return nil, err
	}
	if fi, _ := f.Stat(); fi != nil && fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%w: %s has mode %v; the secret must be readable by this user only (chmod 600)",
			ErrUnsafe, path, fi.Mode().Perm())
	}
	s := make([]byte, SecretSize+1)
	n, err := io.ReadFull(f, s)
	if n != SecretSize || !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, fmt.Errorf("integrity: secret %s: want exactly %d bytes", path, SecretSize)
	}
	return s[:SecretSize], nil
}
