// Package object is kvbm's G4 tier: KV blocks in an S3-compatible object
// store, shared by every engine instance that reaches the same bucket.
//
// The store itself is the shared truth; nothing else has to run. Each rank
// stores its own shard of a block under
//
//	<fingerprint hex>/<sequence hash as 16 hex digits>
//
// where the fingerprint (package fingerprint) covers everything that makes
// bytes interchangeable (model, dtype, layout, block size, TP size and rank,
// hash scheme), so a different model or TP layout never finds another's
// blocks. Every object starts with a Header that repeats the key's identity
// and carries the payload's XXH3: a download that does not verify is counted,
// deleted and never served.
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
)

// HeaderSize is the size of the header that precedes every payload.
const HeaderSize = 64

var magic = [8]byte{'K', 'V', 'B', 'M', 'G', '4', 'v', '1'}

// ErrCorrupt: an object whose header or payload does not verify.
var ErrCorrupt = errors.New("object: G4 object does not verify")

// Header identifies one stored block shard.
type Header struct {
	Fingerprint fingerprint.Fingerprint
	SeqHash     uint64
	Parent      uint64 // parent's sequence hash; 0 for a first block
	PayloadLen  uint64
	PayloadSum  uint64 // XXH3 of the payload
}

// put writes h into b[:HeaderSize]; the last 8 bytes are the XXH3 of the
// first 56, so a damaged header is recognised as such.
func (h *Header) put(b []byte) {
	copy(b[0:8], magic[:])
	copy(b[8:24], h.Fingerprint[:])
	binary.LittleEndian.PutUint64(b[24:32], h.SeqHash)
	binary.LittleEndian.PutUint64(b[32:40], h.Parent)
	binary.LittleEndian.PutUint64(b[40:48], h.PayloadLen)
	binary.LittleEndian.PutUint64(b[48:56], h.PayloadSum)
	binary.LittleEndian.PutUint64(b[56:64], xxh3.Hash(b[:56]))
}

// Encode returns header + payload as one object body.
func Encode(fp fingerprint.Fingerprint, seqHash, parent uint64, payload []byte) []byte {
	b := make([]byte, HeaderSize+len(payload))
	encodeInto(b, fp, seqHash, parent, payload)
	return b
}

func encodeInto(b []byte, fp fingerprint.Fingerprint, seqHash, parent uint64, payload []byte) {
	copy(b[HeaderSize:], payload)
	h := Header{Fingerprint: fp, SeqHash: seqHash, Parent: parent, PayloadLen: uint64(len(payload)),
		PayloadSum: xxh3.Hash(b[HeaderSize:])}
	h.put(b)
}

// Verify checks that body is the object of (fp, seqHash) with a payload of
// exactly wantLen bytes, and returns its header and payload.
func Verify(body []byte, fp fingerprint.Fingerprint, seqHash uint64, wantLen int) (Header, []byte, error) {
	var h Header
	if len(body) < HeaderSize {
		return h, nil, fmt.Errorf("%w: %d bytes, shorter than its header", ErrCorrupt, len(body))
	}
	if [8]byte(body[0:8]) != magic {
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
	return h, payload, nil
}

// Key is the object key of seqHash under fp.
func Key(fp fingerprint.Fingerprint, seqHash uint64) string {
	return fmt.Sprintf("%s/%016x", fp, seqHash)
}
