// Package object is kvbm's G4 tier: KV blocks in an S3-compatible object
// store, shared by every engine instance that reaches the same bucket.
//
// The store itself is the shared truth; nothing else has to run. Each rank
// stores its own shard of a block under
//
//	g4v2-<fingerprint hex>/<sequence hash as 16 hex digits>
//
// where the fingerprint (package fingerprint) covers everything that makes
// bytes interchangeable (model, dtype, layout, block size, TP size and rank,
// hash scheme), so a different model or TP layout never finds another's
// blocks, and the prefix names the object format, so objects of an older
// format are never even asked for (and never block a key: uploads are
// conditional PUTs). Every object starts with a Header that repeats the
// key's identity, carries the payload's XXH3 (damage) and a MAC under the
// fleet's key (package integrity's Seal) over the key, the header and the
// payload (forgery): a download that does not verify is a miss, counted and
// never served; it is deleted only once this instance has seen the same
// damaged bytes twice.
//
// Uploads go through a bounded queue with bounded concurrency; a full queue
// or an open circuit breaker drops the upload (counted) instead of blocking.
// The breaker opens after consecutive failures and lets one request through
// per cool-down, so an outage costs nothing but the drops and the tier comes
// back by itself. A local Registry (LRU) remembers blocks known to be stored.
package object

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
)

// HeaderSize is the size of the header that precedes every payload.
const HeaderSize = 64 + integrity.SealSize

// KeyPrefix starts every object key of this format (see Key).
const KeyPrefix = "g4v2-"

var (
	magic   = [8]byte{'K', 'V', 'B', 'M', 'G', '4', 'v', '2'}
	magicV1 = [8]byte{'K', 'V', 'B', 'M', 'G', '4', 'v', '1'} // unauthenticated, before the MAC
)

// ErrCorrupt: an object whose header or payload does not verify. Every
// verification failure wraps it; those that are not damage wrap
// ErrUnauthenticated too.
var ErrCorrupt = errors.New("object: G4 object does not verify")

// ErrUnauthenticated: an object whose bytes are intact (its checksums hold)
// but whose MAC does not verify under this instance's key: forged, or
// written by an instance with another key (another DYN_KVBM_STORAGE_SECRET
// or S3 secret key). It proves nothing about damage, so it is never deleted.
var ErrUnauthenticated = fmt.Errorf("%w: MAC mismatch (forged, or written under another key)", ErrCorrupt)

// ErrOldFormat: an object of the unauthenticated format before the MAC,
// treated as absent (it wraps ErrNotFound).
var ErrOldFormat = fmt.Errorf("%w: an object of the older, unauthenticated format", ErrNotFound)

// Header identifies one stored block shard. On the wire:
//
//	[0:8]   magic "KVBMG4v2"
//	[8:24]  fingerprint
//	[24:32] sequence hash      (little endian, as the rest)
//	[32:40] parent's sequence hash
//	[40:48] payload length
//	[48:56] XXH3 of the payload
//	[56:64] XXH3 of [0:56]
//	[64:96] integrity.Key.Seal of the payload under (object key, [0:56]): a
//	        random 16-byte salt, then a 16-byte GMAC tag under a one-time key
//
// The checksums tell damage (a checksum fails) from forgery (they hold, the
// MAC does not): only damage, seen twice, gets an object deleted.
type Header struct {
	Fingerprint fingerprint.Fingerprint
	SeqHash     uint64
	Parent      uint64 // parent's sequence hash; 0 for a first block
	PayloadLen  uint64
	PayloadSum  uint64 // XXH3 of the payload
}

// Encode returns header + payload as one object body, authenticated by key.
func Encode(key integrity.Key, fp fingerprint.Fingerprint, seqHash, parent uint64, payload []byte) []byte {
	b := make([]byte, HeaderSize+len(payload))
	copy(b[HeaderSize:], payload)
	seal(b, key, fp, seqHash, parent)
	return b
}

// seal writes the header of b, whose payload b[HeaderSize:] is in place.
func seal(b []byte, key integrity.Key, fp fingerprint.Fingerprint, seqHash, parent uint64) {
	payload := b[HeaderSize:]
	copy(b[0:8], magic[:])
	copy(b[8:24], fp[:])
	binary.LittleEndian.PutUint64(b[24:32], seqHash)
	binary.LittleEndian.PutUint64(b[32:40], parent)
	binary.LittleEndian.PutUint64(b[40:48], uint64(len(payload)))
	binary.LittleEndian.PutUint64(b[48:56], xxh3.Hash(payload))
	binary.LittleEndian.PutUint64(b[56:64], xxh3.Hash(b[:56]))
	key.Seal(b[64:64:HeaderSize], payload, []byte(Key(fp, seqHash)), b[:56])
}

// Verify checks that body is the object of (fp, seqHash), written under key,
// with a payload of exactly wantLen bytes, and returns its header and
// payload. Errors wrap ErrCorrupt (ErrUnauthenticated for a MAC mismatch of
// intact bytes) or, for the older format, ErrOldFormat.
func Verify(body []byte, key integrity.Key, fp fingerprint.Fingerprint, seqHash uint64, wantLen int) (Header, []byte, error) {
	var h Header
	if len(body) < HeaderSize {
		if len(body) >= 8 && [8]byte(body[0:8]) == magicV1 {
			return h, nil, ErrOldFormat
		}
		return h, nil, fmt.Errorf("%w: %d bytes, shorter than its header", ErrCorrupt, len(body))
	}
	switch [8]byte(body[0:8]) {
	case magic:
	case magicV1:
		return h, nil, ErrOldFormat
	default:
		return h, nil, fmt.Errorf("%w: bad magic %q", ErrCorrupt, body[0:8])
	}
	if got, want := xxh3.Hash(body[:56]), binary.LittleEndian.Uint64(body[56:64]); got != want {
		return h, nil, fmt.Errorf("%w: header checksum %016x, want %016x", ErrCorrupt, got, want)
	}
	copy(h.Fingerprint[:], body[8:24])
	h.SeqHash = binary.LittleEndian.Uint64(body[24:32])
	h.Parent = binary.LittleEndian.Uint64(body[32:40])
	h.PayloadLen = binary.LittleEndian.Uint64(body[40:48])
	h.PayloadSum = binary.LittleEndian.Uint64(body[48:56])
	payload := body[HeaderSize:]
	switch {
	case h.Fingerprint != fp:
		return h, nil, fmt.Errorf("%w: fingerprint %s, want %s", ErrCorrupt, h.Fingerprint, fp)
	case h.SeqHash != seqHash:
		return h, nil, fmt.Errorf("%w: sequence hash %016x, want %016x", ErrCorrupt, h.SeqHash, seqHash)
	case h.PayloadLen != uint64(len(payload)) || len(payload) != wantLen:
		return h, nil, fmt.Errorf("%w: payload %d bytes (header says %d), want %d", ErrCorrupt, len(payload), h.PayloadLen, wantLen)
	}
	if got := xxh3.Hash(payload); got != h.PayloadSum {
		return h, nil, fmt.Errorf("%w: payload checksum %016x, header says %016x", ErrCorrupt, got, h.PayloadSum)
	}
	if !key.Open(body[64:HeaderSize], payload, []byte(Key(fp, seqHash)), body[:56]) {
		return h, nil, ErrUnauthenticated
	}
	return h, payload, nil
}

// damaged reports whether a verification error proves the bytes themselves
// wrong for every instance (a checksum, the magic, the length, or a header
// naming another block), as opposed to a MAC mismatch of intact bytes or an
// older format.
func damaged(err error) bool {
	return errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnauthenticated)
}

// Key is the object key of seqHash under fp.
func Key(fp fingerprint.Fingerprint, seqHash uint64) string {
	return fmt.Sprintf("%s%s/%016x", KeyPrefix, fp, seqHash)
}
