package plan

import (
	"encoding/binary"
	"fmt"
)

// SaltRef gives the salt hash of a block this step's G4 copies or uploads
// name (G4 keys of salted blocks carry a tag of the salt, goext/object's
// salt.go). Blocks not listed have the default salt (no cache salt, no LoRA).
type SaltRef struct {
	Hash uint64 // the block's sequence hash
	Salt uint64 // its request's salt hash (hashing.SaltHash)
}

// Wire format of G4Salts ("gs"): a msgpack bin of saltRefBytes-sized
// little-endian records (hash u64, salt u64).
const saltRefBytes = 16

func appendSaltRefs(dst []byte, rs []SaltRef) []byte {
	for _, r := range rs {
		dst = binary.LittleEndian.AppendUint64(dst, r.Hash)
		dst = binary.LittleEndian.AppendUint64(dst, r.Salt)
	}
	return dst
}

func parseSaltRefs(b []byte) ([]SaltRef, error) {
	if len(b)%saltRefBytes != 0 {
		return nil, fmt.Errorf("salt list of %d bytes is not a multiple of %d", len(b), saltRefBytes) // errprefix: wrapped by Decode
	}
	if len(b) == 0 {
		return nil, nil
	}
	rs := make([]SaltRef, len(b)/saltRefBytes)
	for i := range rs {
		r := b[i*saltRefBytes:]
		rs[i] = SaltRef{Hash: binary.LittleEndian.Uint64(r[0:8]), Salt: binary.LittleEndian.Uint64(r[8:16])}
	}
	return rs, nil
}

// SaltOf returns a lookup from sequence hash to salt hash over the step's
// G4Salts (0 for a hash not listed: the default salt).
func (s *Step) SaltOf() func(hash uint64) uint64 {
	if len(s.G4Salts) == 0 {
		return func(uint64) uint64 { return 0 }
	}
	m := make(map[uint64]uint64, len(s.G4Salts))
	for _, r := range s.G4Salts {
		m[r.Hash] = r.Salt
	}
	return func(h uint64) uint64 { return m[h] }
}
