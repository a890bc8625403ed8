package object_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/object"
)

// FuzzDecodeObject: the G4 object parser on arbitrary bytes (what a hostile
// server can send) never panics, classifies every rejection (damage,
// MAC, older format), and accepts only what the key's holder encoded:
// an accepted body is byte for byte the encoding of what it returns (but
// for the MAC's random salt).
func FuzzDecodeObject(f *testing.F) {
	const n = 64
	key := integrity.ObjectKey(nil, "fuzz-secret", "kv-fuzz")
	fpr := fp("fuzz")
	payload := bytes.Repeat([]byte{1, 2, 3, 4}, n/4)
	valid := object.Encode(key, fpr, 7, 3, payload)
	mut := func(at int) []byte { b := bytes.Clone(valid); b[at] ^= 0x80; return b }
	forged := bytes.Clone(valid)
	forged[object.HeaderSize] ^= 0xff
	binary.LittleEndian.PutUint64(forged[48:56], xxh3.Hash(forged[object.HeaderSize:]))
	binary.LittleEndian.PutUint64(forged[56:64], xxh3.Hash(forged[:56]))
	v1 := append([]byte("KVBMG4v1"), valid[8:64]...)
	for _, seed := range [][]byte{
		valid,
		mut(0), mut(10), mut(30), mut(45), mut(50), mut(60), mut(80), mut(object.HeaderSize + 5),
		forged,
		valid[:len(valid)-1], append(bytes.Clone(valid), 0), valid[:object.HeaderSize], valid[:8], nil,
		append(v1, payload...), v1[:10],
	} {
		f.Add(seed, uint64(7))
	}
	f.Add(valid, uint64(8))
	f.Fuzz(func(t *testing.T, body []byte, seq uint64) {
		h, got, err := object.Verify(body, key, fpr, seq, n)
		if err != nil {
			if !errors.Is(err, object.ErrCorrupt) && !errors.Is(err, object.ErrOldFormat) {
				t.Fatalf("unclassified error: %v", err)
			}
			if got != nil {
				t.Fatalf("a payload with an error: %v", err)
			}
			return
		}
		if h.SeqHash != seq || h.Fingerprint != fpr || len(got) != n {
			t.Fatalf("accepted the wrong block: %+v, %d bytes", h, len(got))
		}
		// The MAC carries a random salt: all but it must be the encoding.
		want := object.Encode(key, fpr, seq, h.Parent, got)
		if !bytes.Equal(want[:64], body[:64]) || !bytes.Equal(want[object.HeaderSize:], body[object.HeaderSize:]) {
			t.Fatalf("accepted a body that is not the encoding of its contents")
		}
	})
}
