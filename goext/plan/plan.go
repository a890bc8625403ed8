// Package plan is the contract between the leader and its workers: the list of
// copies a worker executes for one engine step. The leader builds a Step, the
// engine ships its encoding to every worker (vLLM pickles it inside the
// connector metadata), and each worker executes it on its own shard.
//
// Execution order inside one step (workers rely on it, the leader plans for it):
//
//  0. Drops, when the step is bound: a dropped block may be reused by this
//     same step's saves, so forgetting it afterwards would lose their data.
//  1. Loads (G2/G3 → G1) at start_load_kv, before the forward pass reads G1;
//     a G4 block comes down into a G2 block first (G4 → G2, then G2 → G1).
//  2. Moves (G2 → G3) at wait_for_save, before any save can overwrite their source.
//  3. Saves (G1 → G2, or G1 → G3 in disk-only mode) at wait_for_save, after the
//     forward pass wrote the step's KV.
//  4. Uploads (G2 → G4) right after the Saves: each block is copied into the
//     upload queue before the next step can overwrite it.
//
// A worker executes steps strictly in order, so a block saved in step N can be
// loaded in step N+1 or later.
package plan

import (
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/internal/mpbound"
)

// Tier names where a block lives.
type Tier uint8

const (
	G1 Tier = 1 // the engine's own KV cache (device memory, or host memory on CPU engines)
	G2 Tier = 2 // kvbm host memory
	G3 Tier = 3 // kvbm local disk
	// G4 is object storage shared by every engine instance. A copy from or
	// to G4 names the block by its sequence hash (the uint64 as int64), not
	// by an index: G4 → G2 downloads one object into a G2 (bounce) block.
	G4 Tier = 4
)

func (t Tier) String() string {
	switch t {
	case G1:
		return "G1"
	case G2:
		return "G2"
	case G3:
		return "G3"
	case G4:
		return "G4"
	}
	return fmt.Sprintf("Tier(%d)", uint8(t))
}

// Copy moves one whole block (all layers, K and V) between tiers.
type Copy struct {
	Src      Tier  `msgpack:"s"`
	SrcBlock int64 `msgpack:"sb"`
	Dst      Tier  `msgpack:"d"`
	DstBlock int64 `msgpack:"db"`
}

// Load is the set of copies that onboard one request's matched prefix into
// its G1 blocks. The worker reports ReqID as finished loading once all its
// copies are done (successfully or not; failures are reported per G1 block).
type Load struct {
	ReqID  string `msgpack:"r"`
	Copies []Copy `msgpack:"c"`
}

// Step is everything a worker must do for one engine step.
type Step struct {
	// Seq numbers engine steps 1, 2, …. A step sent over the side channel
	// (goext/wire, not tied to an engine step) carries the number of the
	// engine step it must follow; worker.Run waits until that step's saves ran.
	Seq   uint64 `msgpack:"q"`
	Loads []Load `msgpack:"l,omitempty"`
	Moves []Copy `msgpack:"m,omitempty"`
	Saves []Copy `msgpack:"v,omitempty"`
	// Drops lists G2/G3 blocks whose contents are no longer valid (evicted
	// or failed verification); workers forget their checksums.
	Drops []Copy `msgpack:"x,omitempty"`
	// Tags describe the blocks this step's G3 writes store (tags.go).
	Tags []BlockTag `msgpack:"t,omitempty"`
	// HostTags describe the blocks this step's G2 writes store, for a later
	// side-channel G2→G3 move; TagRefs are how that move names them
	// (tags.go). A step sent over the side channel carries no Tags or
	// HostTags, only TagRefs.
	HostTags []HostTag `msgpack:"ht,omitempty"`
	TagRefs  []TagRef  `msgpack:"tr,omitempty"`
	// Uploads are G2 blocks to upload to G4 after the step's Saves (the
	// worker copies each into its upload queue at once; the network part
	// runs in the background).
	Uploads []Upload `msgpack:"u,omitempty"`
	// G4Salts names the salt of each salted block among Uploads and the
	// G4 sources of Loads (salts.go).
	G4Salts []SaltRef `msgpack:"gs,omitempty"`
	// G1Groups gives, for an engine with several KV cache groups, the
	// block of every group at each G1 block this step copies (groups.go).
	G1Groups *GroupRows `msgpack:"g,omitempty"`
}

// Upload is one G2 block to store in G4 under its sequence hash.
type Upload struct {
	Block  int64  // G2 block
	Hash   uint64 // sequence hash (the object key)
	Parent uint64 // the parent block's sequence hash, 0 for a first block
}

// Wire format of Uploads: a msgpack bin of uploadBytes-sized little-endian
// records (block i64, hash u64, parent u64).
const uploadBytes = 24

// Empty reports whether the step carries no work.
func (s *Step) Empty() bool {
	return len(s.Loads) == 0 && len(s.Moves) == 0 && len(s.Saves) == 0 && len(s.Drops) == 0 && len(s.Uploads) == 0
}

// Wire format: a msgpack map {"q": seq, "l": [{"r": req_id, "c": copies}],
// "m": copies, "v": copies, "x": copies, "u": uploads, "t", "ht", "tr": tags (tags.go)} where copies is a msgpack bin of
// copyBytes-sized little-endian records (src tier u8, src block i64, dst tier
// u8, dst block i64). A 2,048-block onboard decodes in microseconds instead of
// a map per copy. Python reads it too (kvbm.vllm_integration.connector).
const copyBytes = 18

// Encode serialises the step.
func (s *Step) Encode() ([]byte, error) { return msgpack.Marshal(s) }

// Decode parses an encoded step. A plan can come from anyone who reaches
// the side channel, so its declared lengths are checked against its size
// before the msgpack decoder allocates for them.
func Decode(b []byte) (*Step, error) {
	if err := mpbound.Check(b); err != nil {
		return nil, fmt.Errorf("plan: decode step plan (%d bytes): %w", len(b), err)
	}
	var s Step
	if err := msgpack.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("plan: decode step plan (%d bytes): %w", len(b), err)
	}
	return &s, nil
}

func appendCopies(dst []byte, cs []Copy) []byte {
	for _, c := range cs {
		dst = append(dst, byte(c.Src))
		dst = binary.LittleEndian.AppendUint64(dst, uint64(c.SrcBlock))
		dst = append(dst, byte(c.Dst))
		dst = binary.LittleEndian.AppendUint64(dst, uint64(c.DstBlock))
	}
	return dst
}

func parseCopies(b []byte) ([]Copy, error) {
	if len(b)%copyBytes != 0 {
		return nil, fmt.Errorf("copy list of %d bytes is not a multiple of %d", len(b), copyBytes) // errprefix: wrapped by Decode
	}
	if len(b) == 0 {
		return nil, nil
	}
	cs := make([]Copy, len(b)/copyBytes)
	for i := range cs {
		r := b[i*copyBytes:]
		cs[i] = Copy{
			Src:      Tier(r[0]),
			SrcBlock: int64(binary.LittleEndian.Uint64(r[1:9])),
			Dst:      Tier(r[9]),
			DstBlock: int64(binary.LittleEndian.Uint64(r[10:18])),
		}
	}
	return cs, nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (s *Step) EncodeMsgpack(enc *msgpack.Encoder) error {
	n := 1
	for _, present := range []bool{len(s.Loads) > 0, len(s.Moves) > 0, len(s.Saves) > 0, len(s.Drops) > 0,
		len(s.Tags) > 0, len(s.Uploads) > 0, len(s.HostTags) > 0, len(s.TagRefs) > 0, s.G1Groups != nil,
		len(s.G4Salts) > 0} {
		if present {
			n++
		}
	}
	if err := enc.EncodeMapLen(n); err != nil {
		return err
	}
	if err := enc.EncodeString("q"); err != nil {
		return err
	}
	if err := enc.EncodeUint(s.Seq); err != nil {
		return err
	}
	var buf []byte
	if len(s.Loads) > 0 {
		if err := enc.EncodeString("l"); err != nil {
			return err
		}
		if err := enc.EncodeArrayLen(len(s.Loads)); err != nil {
			return err
		}
		for _, ld := range s.Loads {
			buf = appendCopies(buf[:0], ld.Copies)
			if err := encodeFields(enc, "r", ld.ReqID, "c", buf); err != nil {
				return err
			}
		}
	}
	for _, f := range []struct {
		key string
		cs  []Copy
	}{{"m", s.Moves}, {"v", s.Saves}, {"x", s.Drops}} {
		if len(f.cs) == 0 {
			continue
		}
		buf = appendCopies(buf[:0], f.cs)
		if err := enc.EncodeString(f.key); err != nil {
			return err
		}
		if err := enc.EncodeBytes(buf); err != nil {
			return err
		}
	}
	if len(s.Tags) > 0 {
		if err := enc.EncodeString("t"); err != nil {
			return err
		}
		if err := enc.EncodeBytes(AppendTags(buf[:0], s.Tags)); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		key string
		b   func([]byte) []byte
		n   int
	}{
		{"ht", func(b []byte) []byte { return appendHostTags(b, s.HostTags) }, len(s.HostTags)},
		{"tr", func(b []byte) []byte { return appendTagRefs(b, s.TagRefs) }, len(s.TagRefs)},
		{"gs", func(b []byte) []byte { return appendSaltRefs(b, s.G4Salts) }, len(s.G4Salts)},
	} {
		if f.n == 0 {
			continue
		}
		if err := enc.EncodeString(f.key); err != nil {
			return err
		}
		if err := enc.EncodeBytes(f.b(buf[:0])); err != nil {
			return err
		}
	}
	if len(s.Uploads) > 0 {
		buf = buf[:0]
		for _, u := range s.Uploads {
			buf = binary.LittleEndian.AppendUint64(buf, uint64(u.Block))
			buf = binary.LittleEndian.AppendUint64(buf, u.Hash)
			buf = binary.LittleEndian.AppendUint64(buf, u.Parent)
		}
		if err := enc.EncodeString("u"); err != nil {
			return err
		}
		if err := enc.EncodeBytes(buf); err != nil {
			return err
		}
	}
	if s.G1Groups != nil {
		if err := enc.EncodeString("g"); err != nil {
			return err
		}
		if err := enc.EncodeBytes(s.G1Groups.append(buf[:0])); err != nil {
			return err
		}
	}
	return nil
}

func parseUploads(b []byte) ([]Upload, error) {
	if len(b)%uploadBytes != 0 {
		return nil, fmt.Errorf("upload list of %d bytes is not a multiple of %d", len(b), uploadBytes) // errprefix: wrapped by Decode
	}
	if len(b) == 0 {
		return nil, nil
	}
	us := make([]Upload, len(b)/uploadBytes)
	for i := range us {
		r := b[i*uploadBytes:]
		us[i] = Upload{Block: int64(binary.LittleEndian.Uint64(r[0:8])),
			Hash: binary.LittleEndian.Uint64(r[8:16]), Parent: binary.LittleEndian.Uint64(r[16:24])}
	}
	return us, nil
}

func encodeFields(enc *msgpack.Encoder, k1, v1 string, k2 string, v2 []byte) error {
	if err := enc.EncodeMapLen(2); err != nil {
		return err
	}
	if err := enc.EncodeString(k1); err != nil {
		return err
	}
	if err := enc.EncodeString(v1); err != nil {
		return err
	}
	if err := enc.EncodeString(k2); err != nil {
		return err
	}
	return enc.EncodeBytes(v2)
}

// DecodeMsgpack implements msgpack.CustomDecoder. Unknown keys are skipped
// so that a newer leader's additions do not break an older worker.
func (s *Step) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeMapLen()
	if err != nil {
		return err
	}
	if n < 0 {
		return fmt.Errorf("step plan is nil") // errprefix: wrapped by Decode
	}
	for i := 0; i < n; i++ {
		key, err := dec.DecodeString()
		if err != nil {
			return err
		}
		switch key {
		case "q":
			if s.Seq, err = dec.DecodeUint64(); err != nil {
				return err
			}
		case "l":
			m, err := dec.DecodeArrayLen()
			if err != nil {
				return err
			}
			// An empty or nil list decodes as nil, as Encode omits it.
			// The capacity is bounded: DecodeMsgpack also runs on input
			// that Decode did not check.
			s.Loads = nil
			if m > 0 {
				s.Loads = make([]Load, 0, min(m, 1024))
			}
			for j := 0; j < m; j++ {
				ld, err := decodeLoad(dec)
				if err != nil {
					return fmt.Errorf("load %d: %w", j, err) // errprefix: wrapped by Decode
				}
				s.Loads = append(s.Loads, ld)
			}
		case "m", "v", "x":
			b, err := dec.DecodeBytes()
			if err != nil {
				return err
			}
			cs, err := parseCopies(b)
			if err != nil {
				return fmt.Errorf("%q: %w", key, err) // errprefix: wrapped by Decode
			}
			switch key {
			case "m":
				s.Moves = cs
			case "v":
				s.Saves = cs
			default:
				s.Drops = cs
			}
		case "t":
			b, err := dec.DecodeBytes()
			if err != nil {
				return err
			}
			if s.Tags, err = parseTags(b); err != nil {
				return fmt.Errorf("%q: %w", key, err) // errprefix: wrapped by Decode
			}
		case "ht", "tr", "gs":
			b, err := dec.DecodeBytes()
			if err != nil {
				return err
			}
			switch key {
			case "ht":
				s.HostTags, err = parseHostTags(b)
			case "tr":
				s.TagRefs, err = parseTagRefs(b)
			default:
				s.G4Salts, err = parseSaltRefs(b)
			}
			if err != nil {
				return fmt.Errorf("%q: %w", key, err) // errprefix: wrapped by Decode
			}
		case "u":
			b, err := dec.DecodeBytes()
			if err != nil {
				return err
			}
			if s.Uploads, err = parseUploads(b); err != nil {
				return fmt.Errorf("%q: %w", key, err) // errprefix: wrapped by Decode
			}
		case "g":
			b, err := dec.DecodeBytes()
			if err != nil {
				return err
			}
			if s.G1Groups, err = parseGroupRows(b); err != nil {
				return fmt.Errorf("%q: %w", key, err) // errprefix: wrapped by Decode
			}
		default:
			if err := dec.Skip(); err != nil {
				return err
			}
		}
	}
	return nil
}

func decodeLoad(dec *msgpack.Decoder) (Load, error) {
	var ld Load
	n, err := dec.DecodeMapLen()
	if err != nil {
		return ld, err
	}
	for i := 0; i < n; i++ {
		key, err := dec.DecodeString()
		if err != nil {
			return ld, err
		}
		switch key {
		case "r":
			if ld.ReqID, err = dec.DecodeString(); err != nil {
				return ld, err
			}
		case "c":
			b, err := dec.DecodeBytes()
			if err != nil {
				return ld, err
			}
			if ld.Copies, err = parseCopies(b); err != nil {
				return ld, err
			}
		default:
			if err := dec.Skip(); err != nil {
				return ld, err
			}
		}
	}
	return ld, nil
}
