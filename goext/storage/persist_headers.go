package storage

import (
	"encoding/binary"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/integrity"
)

// headerWriter writes block headers in the background. A header is a
// 4 KiB write whose latency, paid inline, cost about 10% of G3 write
// throughput (bench/g3persist); queued, it overlaps the next payloads.
//
// Ordering: a header is queued only after its payload's write returned,
// and a slot's next write (or invalidation) first waits until the slot
// has no header write queued or running, so a header never lands after
// the bytes it describes were replaced. A header still queued when the
// process dies is simply missing: that block is not recovered.
type headerWriter struct {
	d    *DiskRegion
	jobs chan headerJob
	log  *slog.Logger
	wg   sync.WaitGroup

	pending []atomic.Bool // slot has a header write queued or running
	failed  atomic.Bool

	// mu guards no field: with done it waits for a slot's pending flag to
	// clear (the writer broadcasts after clearing it).
	mu   sync.Mutex
	done *sync.Cond // on mu

	sendMu sync.RWMutex // guards closed: senders (read) against close (write)
	closed bool
}

type headerJob struct {
	i   int
	buf *[]byte // from headerBufs
}

// headerWriters is how many header writes run at once.
const headerWriters = 4

func newHeaderWriter(d *DiskRegion, log *slog.Logger) *headerWriter {
	hw := &headerWriter{d: d, pending: make([]atomic.Bool, d.numBlocks), jobs: make(chan headerJob, 256), log: log}
	hw.done = sync.NewCond(&hw.mu)
	for range headerWriters {
		hw.wg.Add(1)
		go hw.run() // joined by close
	}
	return hw
}

func (hw *headerWriter) run() {
	defer hw.wg.Done()
	for j := range hw.jobs {
		err := hw.d.writeHeader(j.i, *j.buf)
		headerBufs.Put(j.buf)
		if err == nil {
			hw.d.live[j.i].Store(true)
		} else if hw.failed.CompareAndSwap(false, true) {
			hw.log.Warn("kvbm disk tier: a block header could not be written; such blocks are not recovered at "+
				"the next start", "path", hw.d.path, "err", err)
		}
		hw.mu.Lock()
		hw.pending[j.i].Store(false)
		hw.done.Broadcast()
		hw.mu.Unlock()
	}
}

// wait returns once slot i has no header write queued or running.
func (hw *headerWriter) wait(i int) {
	if !hw.pending[i].Load() {
		return
	}
	hw.mu.Lock()
	for hw.pending[i].Load() {
		hw.done.Wait()
	}
	hw.mu.Unlock()
}

// enqueue queues buf as slot i's header; false once closed (the caller
// writes it itself).
func (hw *headerWriter) enqueue(i int, buf *[]byte) bool {
	hw.sendMu.RLock()
	defer hw.sendMu.RUnlock()
	if hw.closed {
		return false
	}
	hw.pending[i].Store(true)
	hw.jobs <- headerJob{i: i, buf: buf}
	return true
}

// close writes what is queued and stops the writers.
func (hw *headerWriter) close() {
	hw.sendMu.Lock()
	if !hw.closed {
		hw.closed = true
		close(hw.jobs)
	}
	hw.sendMu.Unlock()
	hw.wg.Wait()
}

// Block header encoding (format version 2, docs/persistent-g3.md).
//
// A header is authenticated: a MAC under the tier's key (integrity.LocalKey)
// covers every byte before it, so the fingerprint, block index, sequence
// hash, parent, tokens and the payload's own MAC it records were written by
// a holder of the key, for this slot. The payload MAC binds the payload to
// the same identity (fingerprint, index, sequence hash, parent): a payload
// moved to another slot, or swapped with another block's, does not verify.
// The XXH3 at the very end only tells a torn write (bad XXH3) from a header
// that is whole but not authentic (bad MAC).

// headerFields is the field layout (little-endian):
//
//	0   magic 8            56  priority 4
//	8   version 4          60  token count 4
//	12  flags 4            64  payload length 8
//	16  fingerprint 16     72  payload XXH3 8
//	32  block index 8      80  written at (Unix ns) 8
//	40  sequence hash 8    88  payload MAC 32
//	48  parent 8           120 tokens, 4 bytes each
//
// then zeros up to headerMACAt, the header MAC (32) and the XXH3 (8).
const (
	headerPayloadMACAt = 88
	// headerMACAt is where the header's MAC (over bytes [0, headerMACAt)) sits.
	headerMACAt = headerSumAt - integrity.Size
)

// Domain separation of the two MACs under one key.
var (
	macHeader  = []byte("kvbm g3 header")
	macPayload = []byte("kvbm g3 payload")
)

// payloadID is what a payload's MAC binds it to: the tier's fingerprint,
// the block's index, and the identity h claims for it.
func (d *DiskRegion) payloadID(i int, h *BlockHeader) [8 + 8 + 8 + 8]byte {
	var id [8 + 8 + 8 + 8]byte
	le := binary.LittleEndian
	le.PutUint64(id[0:], uint64(i))
	le.PutUint64(id[8:], h.SeqHash)
	le.PutUint64(id[16:], h.Parent)
	if h.HasParent {
		id[24] = 1
	}
	return id
}

// payloadMAC seals block i's payload (its first blockBytes bytes) under the
// identity h claims for it (integrity.Key.Seal: a random salt and a tag).
func (d *DiskRegion) payloadMAC(i int, h *BlockHeader, payload []byte) [integrity.SealSize]byte {
	id := d.payloadID(i, h)
	var out [integrity.SealSize]byte
	d.key.Seal(out[:0], payload[:d.blockBytes], macPayload, d.fp[:], id[:])
	return out
}

// payloadVerifies reports whether mac (from payloadMAC) seals payload
// under the identity h claims for block i.
func (d *DiskRegion) payloadVerifies(i int, h *BlockHeader, payload []byte, mac []byte) bool {
	id := d.payloadID(i, h)
	return d.key.Open(mac, payload[:d.blockBytes], macPayload, d.fp[:], id[:])
}

// encodeHeader fills buf (HeaderBytes) with block i's header; mac is the
// payload's MAC (payloadMAC).
func (d *DiskRegion) encodeHeader(buf []byte, i int, h *BlockHeader, mac *[integrity.SealSize]byte) {
	clear(buf)
	le := binary.LittleEndian
	copy(buf[0:8], headerMagic)
	le.PutUint32(buf[8:], headerVersion)
	var flags uint32
	if h.HasParent {
		flags |= flagHasParent
	}
	toks := h.Tokens
	if len(toks) > MaxHeaderTokens {
		toks = nil
	}
	if toks != nil {
		flags |= flagTokens
	}
	le.PutUint32(buf[12:], flags)
	copy(buf[16:32], d.fp[:])
	le.PutUint64(buf[32:], uint64(i))
	le.PutUint64(buf[40:], h.SeqHash)
	le.PutUint64(buf[48:], h.Parent)
	le.PutUint32(buf[56:], uint32(h.Priority))
	le.PutUint32(buf[60:], uint32(len(toks)))
	le.PutUint64(buf[64:], uint64(d.blockBytes))
	le.PutUint64(buf[72:], h.PayloadSum)
	le.PutUint64(buf[80:], uint64(h.WrittenAt))
	copy(buf[headerPayloadMACAt:headerFixed], mac[:])
	for k, t := range toks {
		le.PutUint32(buf[headerFixed+4*k:], t)
	}
	d.key.Sum(buf[headerMACAt:headerMACAt], macHeader, buf[:headerMACAt])
	le.PutUint64(buf[headerSumAt:], xxh3.Hash(buf[:headerSumAt]))
}

// decodeHeader parses block i's header from buf (HeaderBytes; a shorter
// buf is a torn header). reason is "" for a header that verifies, "empty"
// for a slot never written (or invalidated), else a Discard reason. mac is
// the payload MAC the header records.
func (d *DiskRegion) decodeHeader(buf []byte, i int) (h BlockHeader, mac [integrity.SealSize]byte, reason string) {
	if len(buf) != HeaderBytes {
		return h, mac, DiscardTorn
	}
	le := binary.LittleEndian
	if string(buf[0:8]) != headerMagic {
		for _, c := range buf[:headerFixed] {
			if c != 0 {
				return h, mac, DiscardTorn
			}
		}
		return h, mac, "empty"
	}
	if xxh3.Hash(buf[:headerSumAt]) != le.Uint64(buf[headerSumAt:]) {
		return h, mac, DiscardTorn
	}
	if le.Uint32(buf[8:]) != headerVersion {
		return h, mac, DiscardVersion
	}
	var want [integrity.Size]byte
	d.key.Sum(want[:0], macHeader, buf[:headerMACAt])
	if !d.key.Valid() || !integrity.Equal(want[:], buf[headerMACAt:headerSumAt]) {
		return h, mac, DiscardUnauthenticated
	}
	if string(buf[16:32]) != string(d.fp[:]) {
		return h, mac, DiscardFingerprint
	}
	if le.Uint64(buf[32:]) != uint64(i) {
		return h, mac, DiscardMisplaced
	}
	if le.Uint64(buf[64:]) != uint64(d.blockBytes) {
		return h, mac, DiscardLength
	}
	flags := le.Uint32(buf[12:])
	n := int(le.Uint32(buf[60:]))
	if n > MaxHeaderTokens || flags&^(flagHasParent|flagTokens) != 0 || (flags&flagTokens == 0 && n != 0) {
		return h, mac, DiscardTorn // authentic but not a header this version writes
	}
	h = BlockHeader{
		SeqHash: le.Uint64(buf[40:]), Parent: le.Uint64(buf[48:]), HasParent: flags&flagHasParent != 0,
		Priority: int32(le.Uint32(buf[56:])), PayloadSum: le.Uint64(buf[72:]), WrittenAt: int64(le.Uint64(buf[80:])),
	}
	if flags&flagTokens != 0 {
		h.Tokens = make([]uint32, n)
		for k := range h.Tokens {
			h.Tokens[k] = le.Uint32(buf[headerFixed+4*k:])
		}
	}
	copy(mac[:], buf[headerPayloadMACAt:headerFixed])
	return h, mac, ""
}
