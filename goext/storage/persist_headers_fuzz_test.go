package storage

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/integrity"
)

// FuzzDecodeHeader feeds the G3 header parser arbitrary bytes: it must not
// panic, and no input without the key's MAC may verify. A header built from
// the fuzzed fields must round-trip, and stop verifying when any one of its
// bytes changes.
//
//	go test -run '^$' -fuzz FuzzDecodeHeader ./goext/storage
func FuzzDecodeHeader(f *testing.F) {
	d := &DiskRegion{fp: fpA, blockBytes: pBlockBytes, key: testKey}
	valid := make([]byte, HeaderBytes)
	mac := [integrity.Size]byte{1, 2, 3}
	d.encodeHeader(valid, 3, &BlockHeader{SeqHash: 7, Parent: 6, HasParent: true, Priority: 2, Tokens: []uint32{1, 2},
		PayloadSum: 9, WrittenAt: 10}, &mac)
	v1 := bytes.Clone(valid) // the old format's version, resealed
	binary.LittleEndian.PutUint32(v1[8:], 1)
	binary.LittleEndian.PutUint64(v1[headerSumAt:], xxh3.Hash(v1[:headerSumAt]))
	f.Add(valid, uint64(7), uint64(6), uint16(2), uint16(100))
	f.Add(v1, uint64(0), uint64(0), uint16(0), uint16(8))
	f.Add(make([]byte, HeaderBytes), uint64(1), uint64(0), uint16(MaxHeaderTokens), uint16(4095))
	f.Add([]byte(headerMagic), uint64(^uint64(0)), uint64(1), uint16(MaxHeaderTokens+1), uint16(0))
	f.Add([]byte{}, uint64(0), uint64(0), uint16(0), uint16(headerSumAt))

	f.Fuzz(func(t *testing.T, raw []byte, seq, parent uint64, ntok, flip uint16) {
		// Arbitrary bytes, resealed so that they reach the checks past the
		// XXH3: only the MAC stands between them and recovery.
		buf := make([]byte, HeaderBytes)
		copy(buf, raw)
		if _, _, reason := d.decodeHeader(buf, 3); reason == "" && !bytes.Equal(buf, valid) {
			t.Fatalf("arbitrary bytes verified")
		}
		binary.LittleEndian.PutUint64(buf[headerSumAt:], xxh3.Hash(buf[:headerSumAt]))
		if _, _, reason := d.decodeHeader(buf, 3); reason == "" && !bytes.Equal(buf, valid) {
			t.Fatalf("resealed arbitrary bytes verified")
		}
		_, _, _ = d.decodeHeader(raw, 3) // any length

		// A header of the fuzzed fields round-trips ...
		toks := make([]uint32, int(ntok)%(MaxHeaderTokens+2))
		for k := range toks {
			toks[k] = uint32(seq) + uint32(k)
		}
		h := BlockHeader{SeqHash: seq, Parent: parent, HasParent: parent&1 == 1, Priority: int32(ntok),
			Tokens: toks, PayloadSum: seq ^ parent, WrittenAt: int64(parent)}
		var m [integrity.Size]byte
		copy(m[:], raw)
		d.encodeHeader(buf, 5, &h, &m)
		got, gotMAC, reason := d.decodeHeader(buf, 5)
		if reason != "" {
			t.Fatalf("own header: %s", reason)
		}
		if len(toks) > MaxHeaderTokens {
			h.Tokens = nil
		}
		if got.SeqHash != h.SeqHash || got.Parent != h.Parent || got.HasParent != h.HasParent ||
			got.Priority != h.Priority || got.PayloadSum != h.PayloadSum || got.WrittenAt != h.WrittenAt ||
			gotMAC != m || len(got.Tokens) != len(h.Tokens) || (h.Tokens == nil) != (got.Tokens == nil) {
			t.Fatalf("round trip: got %+v, want %+v", got, h)
		}
		for k := range h.Tokens {
			if got.Tokens[k] != h.Tokens[k] {
				t.Fatalf("token %d: got %d, want %d", k, got.Tokens[k], h.Tokens[k])
			}
		}
		// ... names its slot ...
		if _, _, reason := d.decodeHeader(buf, 4); reason != DiscardMisplaced {
			t.Fatalf("header of slot 5 at slot 4: %q", reason)
		}
		// ... and any changed byte (resealed or not) makes it fail.
		at := int(flip) % HeaderBytes
		buf[at] ^= 1 + byte(seq)%255
		if _, _, reason := d.decodeHeader(buf, 5); reason == "" {
			t.Fatalf("byte %d changed: still verifies", at)
		}
		if at < headerSumAt {
			binary.LittleEndian.PutUint64(buf[headerSumAt:], xxh3.Hash(buf[:headerSumAt]))
			if _, _, reason := d.decodeHeader(buf, 5); reason == "" {
				t.Fatalf("byte %d changed and resealed: still verifies", at)
			}
		}
	})
}

// BenchmarkPayloadMAC is the MAC a persistent tier computes per block
// written (and per load of a recovered block), against the XXH3 every G3
// write and load computes: 2 MiB, a vLLM-like block of one rank.
//
//	go test -run '^$' -bench Payload ./goext/storage
func BenchmarkPayloadMAC(b *testing.B) {
	d := &DiskRegion{fp: fpA, blockBytes: 2 << 20, key: testKey}
	buf := make([]byte, d.blockBytes)
	h := &BlockHeader{SeqHash: 1, Parent: 2, HasParent: true}
	b.SetBytes(d.blockBytes)
	for b.Loop() {
		d.payloadMAC(3, h, buf)
	}
}

func BenchmarkPayloadXXH3(b *testing.B) {
	buf := make([]byte, 2<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		xxh3.Hash(buf)
	}
}
