package object

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/hashing"
)

// Salted keys (docs/g4.md, "Purge and expiry").
//
// A block of a request with a cache salt or a LoRA adapter (a salt hash
// other than hashing.DefaultSaltHash) is stored under
//
//	g4v2-s<salt tag, 16 hex digits>/<fingerprint hex>/<sequence hash, 16 hex digits>
//
// so that every object of one salt, for every model and tensor-parallel
// rank, lies under one prefix: a purge of that salt lists only that prefix,
// never the whole bucket. The tag is the first 64 bits of a MAC of the salt
// hash under the objects' key: a listing of the bucket does not tell which
// tenant a prefix belongs to (salt hashes of guessable salts could be
// recomputed by anyone; the tag needs the key). Blocks of requests without
// salt or LoRA keep Key's unsalted form, so objects stored before salted
// keys existed are still found.

// saltTagLabel separates the salt tag's MAC from every other use of the key.
var saltTagLabel = []byte("kvbm g4 salt tag v1")

// SaltTag is the tag of salt hash salt in object keys: "" for the default
// salt (and for 0, which callers use for it), else 16 hex digits.
func (s *Store) SaltTag(salt uint64) string { return SaltTag(s.key, salt) }

// SaltPrefix is the key prefix under which every object of salt hash salt
// lies ("" for the default salt, whose objects have no prefix of their own).
func (s *Store) SaltPrefix(salt uint64) string {
	tag := s.SaltTag(salt)
	if tag == "" {
		return ""
	}
	return KeyPrefix + "s" + tag + "/"
}

// SaltTag is Store.SaltTag under the objects' MAC key k.
func SaltTag(k interface {
	Sum([]byte, ...[]byte) []byte
}, salt uint64) string {
	if salt == 0 || salt == hashing.DefaultSaltHash {
		return ""
	}
	var le [8]byte
	binary.LittleEndian.PutUint64(le[:], salt)
	var buf [32]byte
	return hex.EncodeToString(k.Sum(buf[:0], saltTagLabel, le[:])[:8])
}

// SaltKey is the object key of seqHash under fp for a salt of tag tag.
func SaltKey(tag string, fp fingerprint.Fingerprint, seqHash uint64) string {
	return fmt.Sprintf("%ss%s/%s/%016x", KeyPrefix, tag, fp, seqHash)
}

// KeyHash returns the sequence hash an object key of this format names
// (salted or not), and whether key is one.
func KeyHash(key string) (uint64, bool) {
	if !strings.HasPrefix(key, KeyPrefix) {
		return 0, false
	}
	i := strings.LastIndexByte(key, '/')
	if i < 0 || len(key)-i-1 != 16 {
		return 0, false
	}
	h, err := strconv.ParseUint(key[i+1:], 16, 64)
	return h, err == nil
}
