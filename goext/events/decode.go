package events

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// ErrFrameCount is returned for a ZMQ message that has neither 2 nor 3
// frames (design §7.1).
var ErrFrameCount = errors.New("events: unexpected frame count (expected 2 or 3)")

// Decoder decodes engine KV event messages (design §7.1): vLLM's
// msgspec-encoded batches in both their array and map encodings, and the
// map-shaped events of our TensorRT-LLM publisher.
//
// The decoder walks the msgpack stream itself instead of decoding into
// interface{} values: that is several times faster (a batch is read once,
// token ids go straight into a []uint32) and lets one malformed event be
// skipped exactly, value by value, while the rest of its batch is kept.
//
// Only a truncated or structurally broken payload fails the whole batch. A
// Decoder reuses its buffers and is not safe for concurrent use; the
// returned Batch does not alias the input or the decoder.
type Decoder struct {
	p   []byte // the payload being decoded (dec.r reads it)
	r   bytes.Reader
	d   *msgpack.Decoder
	str []byte // scratch for keys and tags, compared without allocating
	bad string // why the event being decoded is invalid; "" while it is fine
	ev  rawEvent
}

// NewDecoder returns a Decoder ready for use.
func NewDecoder() *Decoder {
	dec := &Decoder{str: make([]byte, 0, 64)}
	dec.d = msgpack.NewDecoder(&dec.r)
	return dec
}

// DecodeMessage decodes a package-level one-off message; see
// Decoder.DecodeMessage.
func DecodeMessage(frames [][]byte) (Batch, error) {
	return NewDecoder().DecodeMessage(frames)
}

// DecodeMessage decodes one ZMQ multipart message: [topic, payload] or
// [topic, seq u64 big-endian, payload]. A sequence frame that is not 8 bytes
// long is ignored (the payload is what matters; HasSeq stays false).
func (dec *Decoder) DecodeMessage(frames [][]byte) (Batch, error) {
	var topic, seqFrame, payload []byte
	switch len(frames) {
	case 2:
		topic, payload = frames[0], frames[1]
	case 3:
		topic, seqFrame, payload = frames[0], frames[1], frames[2]
	default:
		return Batch{}, fmt.Errorf("%w: got %d", ErrFrameCount, len(frames))
	}
	b, err := dec.DecodePayload(payload)
	if err != nil {
		return Batch{}, err
	}
	if len(topic) > 0 {
		b.Topic = append([]byte(nil), topic...)
	}
	if len(seqFrame) == 8 {
		b.Seq, b.HasSeq = binary.BigEndian.Uint64(seqFrame), true
	}
	return b, nil
}

// DecodePayload decodes an event batch: msgpack [ts, events, dp_rank, ...]
// or a map with keys ts, events, data_parallel_rank.
func (dec *Decoder) DecodePayload(p []byte) (Batch, error) {
	var b Batch
	dec.p = p
	defer func() { dec.p = nil }() // do not keep the caller's buffer alive
	dec.r.Reset(p)
	dec.d.Reset(&dec.r)
	c, err := dec.d.PeekCode()
	if err != nil {
		return b, fmt.Errorf("events: event batch: empty payload: %w", err)
	}
	switch {
	case isArray(c):
		n, err := dec.d.DecodeArrayLen()
		if err != nil {
			return b, batchErr(err)
		}
		if n < 2 {
			return b, fmt.Errorf("events: event batch: array has %d elements, want [ts, events, dp_rank]", n)
		}
		if err := dec.batchTS(&b); err != nil {
			return b, batchErr(err)
		}
		if err := dec.batchEvents(&b); err != nil {
			return b, err
		}
		if n >= 3 {
			if err := dec.batchRank(&b); err != nil {
				return b, batchErr(err)
			}
		}
		if err := dec.skip(n - 3); err != nil {
			return b, batchErr(err)
		}
	case isMap(c):
		n, err := dec.d.DecodeMapLen()
		if err != nil {
			return b, batchErr(err)
		}
		sawEvents := false
		for range n {
			key, ok, err := dec.readStr()
			if err != nil {
				return b, batchErr(err)
			}
			if !ok {
				if err := dec.skip(1); err != nil {
					return b, batchErr(err)
				}
				continue
			}
			switch string(key) {
			case "ts":
				err = dec.batchTS(&b)
			case "events":
				sawEvents = true
				if err := dec.batchEvents(&b); err != nil {
					return b, err
				}
			case "data_parallel_rank":
				err = dec.batchRank(&b)
			default:
				err = dec.skip(1)
			}
			if err != nil {
				return b, batchErr(err)
			}
		}
		if !sawEvents {
			return b, errors.New("events: event batch: map has no \"events\" key")
		}
	default:
		return b, fmt.Errorf("events: event batch: payload is msgpack %s, want array or map", typeName(c))
	}
	return b, nil
}

func batchErr(err error) error {
	return fmt.Errorf("events: event batch: malformed msgpack: %w", err)
}

// batchTS reads the timestamp; a value of another type is ignored (the
// timestamp is informational).
func (dec *Decoder) batchTS(b *Batch) error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if isInt(c) || c == msgpcode.Float || c == msgpcode.Double {
		b.TS, err = dec.d.DecodeFloat64()
		return err
	}
	return dec.skip(1)
}

// batchRank reads data_parallel_rank: an int or nil; other types ignored.
func (dec *Decoder) batchRank(b *Batch) error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if isInt(c) {
		v, err := dec.d.DecodeInt64()
		if err != nil {
			return err
		}
		if v >= 0 && v <= math.MaxInt32 {
			b.DPRank, b.HasDPRank = int(v), true
		}
		return nil
	}
	return dec.skip(1)
}

func (dec *Decoder) batchEvents(b *Batch) error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return batchErr(err)
	}
	if c == msgpcode.Nil {
		return batchErr(dec.d.DecodeNil())
	}
	if !isArray(c) {
		return fmt.Errorf("events: event batch: events is msgpack %s, want array", typeName(c))
	}
	n, err := dec.d.DecodeArrayLen()
	if err != nil {
		return batchErr(err)
	}
	// A declared length is untrusted, and an EngineEvent is ~100 bytes:
	// reserve for a typical batch only and let append grow beyond it.
	b.Events = make([]EngineEvent, 0, min(n, dec.r.Len(), 64))
	for i := range n {
		dec.bad = ""
		ev, err := dec.event()
		if err != nil {
			return batchErr(fmt.Errorf("event %d: %w", i, err)) // errprefix: wrapped by batchErr
		}
		if dec.bad != "" {
			b.Skipped = append(b.Skipped, EventError{Index: i, Reason: dec.bad})
			continue
		}
		b.Events = append(b.Events, ev)
	}
	return nil
}

// rawEvent collects the fields of one event before validation; which of
// them are set depends on the encoding.
type rawEvent struct {
	kind         Kind
	hashes       []uint64
	hasHashes    bool
	parent       uint64
	hasParent    bool
	tokens       []uint32
	hasTokens    bool
	blockSize    int64
	hasBlockSize bool
	lora         string
	legacyLora   string // a string at index 5 (the reference's own output with LoRA)
	medium       string
	group        int64 // KV cache group (groups.go)
	hasGroup     bool
	groupKind    string
}

// fail records why the current event is invalid (the first reason wins).
func (dec *Decoder) fail(format string, args ...any) {
	if dec.bad == "" {
		dec.bad = fmt.Sprintf(format, args...)
	}
}

// event decodes one event. A returned error means the stream itself is
// broken; an invalid event sets dec.bad and has been consumed exactly.
func (dec *Decoder) event() (EngineEvent, error) {
	dec.ev = rawEvent{}
	c, err := dec.d.PeekCode()
	if err != nil {
		return EngineEvent{}, err
	}
	switch {
	case isArray(c):
		if err := dec.arrayEvent(); err != nil {
			return EngineEvent{}, err
		}
	case isMap(c):
		if err := dec.mapEvent(); err != nil {
			return EngineEvent{}, err
		}
	default:
		dec.fail("event is msgpack %s, want array or map", typeName(c))
		return EngineEvent{}, dec.skip(1)
	}
	if dec.bad != "" {
		return EngineEvent{}, nil
	}
	return dec.validate(), nil
}

func (dec *Decoder) tagKind(tag []byte) (Kind, bool) {
	switch string(tag) {
	case "BlockStored":
		return KindStored, true
	case "BlockRemoved":
		return KindRemoved, true
	case "AllBlocksCleared":
		return KindCleared, true
	}
	return 0, false
}

// arrayEvent decodes a tagged array, by position (design §7.1):
//
//	["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//	 lora_id, medium, lora_name, extra_keys, ...]
//	["BlockRemoved", block_hashes, medium, ...]
//	["AllBlocksCleared", ...]
//
// Fields after block_size (resp. block_hashes) are optional; unknown
// trailing fields are skipped.
func (dec *Decoder) arrayEvent() error {
	n, err := dec.d.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 1 {
		dec.fail("empty event array")
		return nil
	}
	tag, ok, err := dec.readStr()
	if err != nil {
		return err
	}
	if !ok {
		dec.fail("event tag is not a string")
		return dec.skip(n)
	}
	kind, known := dec.tagKind(tag)
	if !known {
		dec.fail("unknown event type %q", tag)
		return dec.skip(n - 1)
	}
	ev := &dec.ev
	ev.kind = kind
	switch kind {
	case KindStored:
		if n < 5 {
			dec.fail("BlockStored array has %d fields, want at least 5", n)
			return dec.skip(n - 1)
		}
		if err := dec.hashesField(); err != nil {
			return err
		}
		if err := dec.parentField(); err != nil {
			return err
		}
		if err := dec.tokensField(); err != nil {
			return err
		}
		if err := dec.blockSizeField(); err != nil {
			return err
		}
		if n > 5 {
			// lora_id (deprecated): read and discarded, except that the
			// reference's consolidator writes lora_name here.
			s, err := dec.optStr("lora_id", true)
			if err != nil {
				return err
			}
			ev.legacyLora = s
		}
		if n > 6 {
			if ev.medium, err = dec.optStr("medium", false); err != nil {
				return err
			}
		}
		if n > 7 {
			if ev.lora, err = dec.optStr("lora_name", false); err != nil {
				return err
			}
		}
		if n > 8 {
			return dec.storedGroupFields(n)
		}
		return nil
	case KindRemoved:
		if n < 2 {
			dec.fail("BlockRemoved array has no block_hashes")
			return nil
		}
		if err := dec.hashesField(); err != nil {
			return err
		}
		if n > 2 {
			if ev.medium, err = dec.optStr("medium", false); err != nil {
				return err
			}
		}
		if n > 3 {
			if err := dec.groupField(); err != nil {
				return err
			}
		}
		return dec.skip(n - 4)
	default: // KindCleared
		return dec.skip(n - 1)
	}
}

// mapEvent decodes a tagged map: {"type": "BlockStored", "block_hashes":
// ..., ...}. Keys may come in any order; unknown keys are skipped; fields
// equal to their default may be absent (msgspec omit_defaults).
func (dec *Decoder) mapEvent() error {
	n, err := dec.d.DecodeMapLen()
	if err != nil {
		return err
	}
	ev := &dec.ev
	sawType := false
	for range n {
		key, ok, err := dec.readStr()
		if err != nil {
			return err
		}
		if !ok {
			dec.fail("event map has a non-string key")
			if err := dec.skip(1); err != nil {
				return err
			}
			continue
		}
		switch string(key) {
		case "type":
			tag, ok, err := dec.readStr()
			if err != nil {
				return err
			}
			if !ok {
				dec.fail("event type is not a string")
				if err := dec.skip(1); err != nil {
					return err
				}
				continue
			}
			kind, known := dec.tagKind(tag)
			if !known {
				dec.fail("unknown event type %q", tag)
			}
			ev.kind, sawType = kind, true
		case "block_hashes":
			err = dec.hashesField()
		case "parent_block_hash":
			err = dec.parentField()
		case "token_ids":
			err = dec.tokensField()
		case "block_size":
			err = dec.blockSizeField()
		case "medium":
			ev.medium, err = dec.optStr("medium", false)
		case "lora_name":
			ev.lora, err = dec.optStr("lora_name", false)
		case "group_idx":
			err = dec.groupField()
		case "kv_cache_spec_kind":
			ev.groupKind, err = dec.optStr("kv_cache_spec_kind", false)
		default:
			err = dec.skip(1)
		}
		if err != nil {
			return err
		}
	}
	if !sawType {
		dec.fail("event map has no \"type\" key")
	}
	return nil
}

// validate checks the event's fields against its kind (design §7.1) and
// returns the typed event; dec.bad is set when it is invalid.
func (dec *Decoder) validate() EngineEvent {
	ev := &dec.ev
	out := EngineEvent{Kind: ev.kind, Medium: ev.medium, Group: int(ev.group), HasGroup: ev.hasGroup,
		GroupKind: ev.groupKind}
	switch ev.kind {
	case KindStored:
		switch {
		case !ev.hasHashes:
			dec.fail("BlockStored without block_hashes")
		case !ev.hasBlockSize:
			dec.fail("BlockStored without block_size")
		case ev.blockSize <= 0:
			dec.fail("invalid block_size %d", ev.blockSize)
		case ev.blockSize > math.MaxInt32:
			dec.fail("block_size %d is too large", ev.blockSize)
		}
		if dec.bad != "" {
			return EngineEvent{}
		}
		bs := int(ev.blockSize)
		chunks := (len(ev.tokens) + bs - 1) / bs
		if chunks != len(ev.hashes) {
			dec.fail("token chunks (%d) don't match block hashes (%d), block_size %d",
				chunks, len(ev.hashes), bs)
			return EngineEvent{}
		}
		out.BlockHashes, out.TokenIDs, out.BlockSize = ev.hashes, ev.tokens, bs
		out.ParentHash, out.HasParent = ev.parent, ev.hasParent
		out.LoraName = ev.lora
		if out.LoraName == "" {
			out.LoraName = ev.legacyLora
		}
	case KindRemoved:
		if !ev.hasHashes {
			dec.fail("BlockRemoved without block_hashes")
			return EngineEvent{}
		}
		out.BlockHashes = ev.hashes
	}
	return out
}

// hashesField reads block_hashes: an array of hashes.
func (dec *Decoder) hashesField() error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if !isArray(c) {
		dec.fail("block_hashes is msgpack %s, want array", typeName(c))
		return dec.skip(1)
	}
	n, err := dec.d.DecodeArrayLen()
	if err != nil {
		return err
	}
	hs := make([]uint64, 0, min(n, dec.r.Len()))
	for i := range n {
		h, present, err := dec.hash()
		if err != nil {
			return err
		}
		if !present {
			dec.fail("block_hashes[%d] is nil", i)
			continue
		}
		hs = append(hs, h)
	}
	dec.ev.hashes, dec.ev.hasHashes = hs, true
	return nil
}

// parentField reads parent_block_hash: a hash or nil.
func (dec *Decoder) parentField() error {
	h, present, err := dec.hash()
	if err != nil {
		return err
	}
	dec.ev.parent, dec.ev.hasParent = h, present
	return nil
}

// hash reads one external hash: a signed or unsigned int (bit-cast to u64)
// or a byte string (its last 8 bytes, big-endian, as vLLM's
// maybe_convert_block_hash does). nil gives present == false. Another type
// marks the event invalid and is skipped.
func (dec *Decoder) hash() (h uint64, present bool, err error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == msgpcode.Nil:
		return 0, false, dec.d.DecodeNil()
	case isInt(c):
		// DecodeUint64 sign-extends the signed encodings, which is the
		// two's-complement bit cast we want for i64 hashes.
		h, err = dec.d.DecodeUint64()
		return h, true, err
	case msgpcode.IsBin(c):
		b, ok, err := dec.readStr()
		if err != nil || !ok {
			return 0, false, err
		}
		if len(b) > 8 {
			b = b[len(b)-8:]
		}
		for _, x := range b {
			h = h<<8 | uint64(x)
		}
		return h, true, nil
	}
	dec.fail("hash is msgpack %s, want int or bytes", typeName(c))
	return 0, false, dec.skip(1)
}

// tokensField reads token_ids: an array of u32.
func (dec *Decoder) tokensField() error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if !isArray(c) {
		dec.fail("token_ids is msgpack %s, want array", typeName(c))
		return dec.skip(1)
	}
	n, err := dec.d.DecodeArrayLen()
	if err != nil {
		return err
	}
	toks := make([]uint32, 0, min(n, dec.r.Len()))
	// Token ids are most of a batch's bytes, so they are parsed straight
	// from the payload rather than value by value through msgpack.Decoder
	// (3-4x faster); anything but an unsigned int falls back to the
	// generic path for that one element. dec.r is re-synchronised after.
	p := dec.p
	pos := len(p) - dec.r.Len()
	for i := range n {
		v, next, ok := rawUint(p, pos)
		if next < 0 {
			return io.ErrUnexpectedEOF
		}
		if ok {
			pos = next
		} else {
			if _, err := dec.r.Seek(int64(pos), io.SeekStart); err != nil {
				return err
			}
			c := p[pos]
			if isInt(c) {
				// A signed encoding: negative ids are invalid; msgpack
				// encoders use signed codes only for negative values,
				// but accept a non-negative one anyway.
				sv, err := dec.d.DecodeInt64()
				if err != nil {
					return err
				}
				v = math.MaxUint64
				if sv >= 0 {
					v = uint64(sv)
				}
			} else {
				dec.fail("token_ids[%d] is msgpack %s, want int", i, typeName(c))
				if err := dec.skip(1); err != nil {
					return err
				}
				v = 0
			}
			pos = len(p) - dec.r.Len()
		}
		if v > math.MaxUint32 {
			dec.fail("token_ids[%d] is out of the u32 range", i)
			continue
		}
		toks = append(toks, uint32(v))
	}
	if _, err := dec.r.Seek(int64(pos), io.SeekStart); err != nil {
		return err
	}
	dec.ev.tokens, dec.ev.hasTokens = toks, true
	return nil
}

// blockSizeField reads block_size: an int.
func (dec *Decoder) blockSizeField() error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if !isInt(c) {
		dec.fail("block_size is msgpack %s, want int", typeName(c))
		return dec.skip(1)
	}
	if c >= msgpcode.Uint8 && c <= msgpcode.Uint64 {
		v, err := dec.d.DecodeUint64()
		if v > math.MaxInt64 {
			v = math.MaxInt64
		}
		dec.ev.blockSize, dec.ev.hasBlockSize = int64(v), true
		return err
	}
	v, err := dec.d.DecodeInt64()
	dec.ev.blockSize, dec.ev.hasBlockSize = v, true
	return err
}

// optStr reads an optional string field (nil → ""). With lenient, any
// other type is skipped silently (lora_id, whose int value we discard);
// otherwise it marks the event invalid.
func (dec *Decoder) optStr(field string, lenient bool) (string, error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		return "", dec.d.DecodeNil()
	}
	if !msgpcode.IsString(c) {
		if !lenient {
			dec.fail("%s is msgpack %s, want string or nil", field, typeName(c))
		}
		return "", dec.skip(1)
	}
	b, _, err := dec.readStr()
	switch string(b) { // the usual mediums: no allocation per event
	case "GPU":
		return "GPU", err
	case "CPU":
		return "CPU", err
	}
	return string(b), err
}

// readStr reads a str or bin value into the scratch buffer (valid until the
// next call). ok is false, and nothing is consumed, when the next value is
// not a string.
func (dec *Decoder) readStr() (b []byte, ok bool, err error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return nil, false, err
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return nil, false, nil
	}
	n, err := dec.d.DecodeBytesLen()
	if err != nil {
		return nil, false, err
	}
	if n > dec.r.Len() {
		return nil, false, fmt.Errorf("string of %d bytes overruns the payload", n) // errprefix: wrapped by batchErr
	}
	if cap(dec.str) < n {
		dec.str = make([]byte, n)
	}
	dec.str = dec.str[:n]
	if err := dec.d.ReadFull(dec.str); err != nil {
		return nil, false, err
	}
	return dec.str, true, nil
}

// skip consumes n values (n ≤ 0: none). It is iterative, not recursive, so
// a deeply nested hostile payload cannot exhaust the stack; each value
// costs at least one input byte, so the loop ends at the end of the input.
func (dec *Decoder) skip(n int) error {
	pending := int64(max(n, 0))
	for pending > 0 {
		pending--
		c, err := dec.d.PeekCode()
		if err != nil {
			return err
		}
		switch {
		case isArray(c):
			l, err := dec.d.DecodeArrayLen()
			if err != nil {
				return err
			}
			pending += int64(max(l, 0))
		case isMap(c):
			l, err := dec.d.DecodeMapLen()
			if err != nil {
				return err
			}
			pending += 2 * int64(max(l, 0))
		case msgpcode.IsString(c) || msgpcode.IsBin(c):
			l, err := dec.d.DecodeBytesLen()
			if err != nil {
				return err
			}
			if err := dec.discard(max(l, 0)); err != nil {
				return err
			}
		case isExt(c):
			if err := dec.skipExt(); err != nil {
				return err
			}
		default:
			// Fixed-size scalars (nil, bool, numbers): at most 9 bytes.
			if err := dec.d.Skip(); err != nil {
				return err
			}
		}
	}
	return nil
}

// discard drops the next n payload bytes. msgpack.Decoder.Skip is not used
// for strings and extensions: it reads a declared length into the
// decoder's internal buffer, growing it by up to 1 MiB per hostile value
// and keeping that memory, so a reused Decoder fed lying lengths would grow
// without bound. The msgpack.Decoder reads dec.r directly (a bytes.Reader
// is a ByteScanner, so it adds no buffer of its own), which makes seeking
// the reader safe.
func (dec *Decoder) discard(n int) error {
	if n > dec.r.Len() {
		return fmt.Errorf("value of %d bytes overruns the payload (%d left)", n, dec.r.Len()) // errprefix: wrapped by batchErr
	}
	_, err := dec.r.Seek(int64(n), io.SeekCurrent)
	return err
}

// skipExt skips one msgpack extension value (fixext or ext 8/16/32).
func (dec *Decoder) skipExt() error {
	c, err := dec.r.ReadByte()
	if err != nil {
		return err
	}
	var n int
	switch c {
	case msgpcode.FixExt1:
		n = 1
	case msgpcode.FixExt2:
		n = 2
	case msgpcode.FixExt4:
		n = 4
	case msgpcode.FixExt8:
		n = 8
	case msgpcode.FixExt16:
		n = 16
	default:
		width := 4 // Ext32
		switch c {
		case msgpcode.Ext8:
			width = 1
		case msgpcode.Ext16:
			width = 2
		}
		var lb [4]byte
		if _, err := io.ReadFull(&dec.r, lb[:width]); err != nil {
			return err
		}
		for _, x := range lb[:width] {
			n = n<<8 | int(x)
		}
	}
	return dec.discard(n + 1) // the type byte, then the data
}

func isInt(c byte) bool {
	return msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64)
}

// rawUint parses an unsigned msgpack integer (positive fixint, uint8..64)
// at p[pos:]. ok is false, with next == pos, for any other type; next is -1
// when the value is truncated.
func rawUint(p []byte, pos int) (v uint64, next int, ok bool) {
	if pos >= len(p) {
		return 0, -1, false
	}
	c := p[pos]
	var w int
	switch {
	case c <= msgpcode.PosFixedNumHigh:
		return uint64(c), pos + 1, true
	case c == msgpcode.Uint8:
		w = 1
	case c == msgpcode.Uint16:
		w = 2
	case c == msgpcode.Uint32:
		w = 4
	case c == msgpcode.Uint64:
		w = 8
	default:
		return 0, pos, false
	}
	if pos+1+w > len(p) {
		return 0, -1, false
	}
	for _, x := range p[pos+1 : pos+1+w] {
		v = v<<8 | uint64(x)
	}
	return v, pos + 1 + w, true
}

func isExt(c byte) bool {
	return (c >= msgpcode.FixExt1 && c <= msgpcode.FixExt16) || (c >= msgpcode.Ext8 && c <= msgpcode.Ext32)
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// typeName names a msgpack type for error messages.
func typeName(c byte) string {
	switch {
	case c == msgpcode.Nil:
		return "nil"
	case c == msgpcode.True || c == msgpcode.False:
		return "bool"
	case isInt(c):
		return "int"
	case c == msgpcode.Float || c == msgpcode.Double:
		return "float"
	case msgpcode.IsString(c):
		return "str"
	case msgpcode.IsBin(c):
		return "bin"
	case isArray(c):
		return "array"
	case isMap(c):
		return "map"
	}
	return fmt.Sprintf("type 0x%02x", c)
}
