package storage

// Persistent disk tier (DYN_KVBM_DISK_PERSIST, docs/persistent-g3.md).
//
// File: <dir>/kvbm-g3-<fingerprint>-rank<r>.tier, block i at offset i × slot,
// slot = HeaderBytes + Stride: one HeaderBytes sector describing the block,
// then its payload (aligned up). The header names the fingerprint, the
// block's index, its sequence hash, parent, priority and tokens, the payload
// length and XXH3, and ends with the XXH3 of the header itself.
//
// Write order for one block (WriteBlockHeader):
//
//  1. if the slot's header may be valid on disk: one pwritev of a zeroed
//     header and the payload (they are adjacent); else a pwrite of the payload;
//  2. a pwrite of the new header, once the first call returned (queued to
//     background writers, persist_headers.go: the slot is not written again
//     until it is done).
//
// A write's bytes land in file order: buffered, the kernel copies page by
// page in ascending order and a fatal signal only stops it between pages
// (a prefix is written); with O_DIRECT the call returns only once all its
// device I/O completed, and a killed process still waits for it. So after a
// kill -9 at any point a header that verifies always describes a payload
// whose write completed: the process's completed writes are in the page
// cache (or on the device) whatever happens to the process. A header torn by the kill fails its own checksum. A power loss
// may persist writes out of order (no fdatasync per block: it would cost a
// device flush per block); the payload checksum in the header is checked on
// every load, so such a block fails its load (the engine recomputes) and is
// never served. Close does fdatasync, so a clean shutdown persists everything.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
)

// HeaderBytes is the size of one block header in a persistent tier file.
const HeaderBytes = 4096

const (
	persistPrefix = "kvbm-g3-"
	persistSuffix = ".tier"
	headerMagic   = "KVBMG3H\x01"
	headerVersion = 1
	// Fixed fields: magic 8, version 4, flags 4, fingerprint 16, index 8,
	// seq hash 8, parent 8, priority 4, token count 4, payload length 8,
	// payload xxh3 8, written-at 8.
	headerFixed = 88
	// headerSumAt is where the header's own XXH3 (over bytes [0, headerSumAt)) sits.
	headerSumAt = HeaderBytes - 8
	// MaxHeaderTokens is how many tokens a header carries; a block with
	// more is persisted without its tokens.
	MaxHeaderTokens = (headerSumAt - headerFixed) / 4

	flagHasParent = 1 << 0
	flagTokens    = 1 << 1
)

// BlockHeader is what a persistent tier records about one block: what the
// leader needs to register it again and announce it to the router.
type BlockHeader struct {
	SeqHash   uint64
	Parent    uint64
	HasParent bool
	Priority  int32
	Tokens    []uint32 // nil when the block had more than MaxHeaderTokens
	// PayloadSum is the XXH3 of the payload's BlockBytes bytes.
	PayloadSum uint64
	// WrittenAt (Unix nanoseconds) orders recovered blocks for eviction.
	WrittenAt int64
}

// RecoveredBlock is one block whose header verified at start.
type RecoveredBlock struct {
	Index int
	BlockHeader
}

// Discard reasons in Recovery.Discarded.
const (
	DiscardTorn        = "torn_header"     // bad magic or header checksum: a write was interrupted
	DiscardVersion     = "header_version"  // written by another format version
	DiscardFingerprint = "fingerprint"     // header of another fingerprint (copied file)
	DiscardMisplaced   = "misplaced"       // header names another block index
	DiscardLength      = "payload_length"  // header for another payload size
	DiscardReadError   = "read_error"      // the header could not be read
	DiscardBeyondSize  = "beyond_new_size" // blocks cut off by a smaller DYN_KVBM_DISK_CACHE_GB
)

// Recovery is what opening a persistent tier found.
type Recovery struct {
	Path      string
	Reused    bool // an existing file was opened (false: created)
	OldBlocks int  // blocks the file held before resizing (0: new file)
	Blocks    []RecoveredBlock
	Empty     int            // slots never written (or invalidated)
	Discarded map[string]int // reason → blocks
	Duration  time.Duration
}

// NumDiscarded is the total of Discarded.
func (r Recovery) NumDiscarded() int {
	n := 0
	for _, v := range r.Discarded {
		n += v
	}
	return n
}

var errPersistBusy = errors.New("storage: persistent tier file is locked by another process")

// PersistentPath is the tier file of fingerprint fp and rank in dir.
func PersistentPath(dir string, fp fingerprint.Fingerprint, rank int) string {
	return filepath.Join(dir, fmt.Sprintf("%s%s-rank%d%s", persistPrefix, fp, rank, persistSuffix))
}

// openPersistent opens (or creates) the persistent tier file, sizes it to
// o.NumBlocks and scans its headers. errPersistBusy: another live process
// holds it.
func openPersistent(o DiskOptions, dir string, log *slog.Logger) (*DiskRegion, error) {
	if o.Fingerprint.IsZero() {
		return nil, errors.New("storage: persistent disk tier (DYN_KVBM_DISK_PERSIST): no fingerprint of the KV layout and model")
	}
	stride := layout.AlignUp(o.BlockBytes, Alignment)
	slot := stride + HeaderBytes
	size := slot * int64(o.NumBlocks)
	if size/int64(o.NumBlocks) != slot {
		return nil, fmt.Errorf("storage: disk tier: %d blocks × %d bytes overflows", o.NumBlocks, slot)
	}
	path := PersistentPath(dir, o.Fingerprint, o.Rank)
	listForeignTiers(dir, path, log)
	fd, odirect, err := openTierFile(path, unix.O_NOFOLLOW, !o.DisableODirect, o.OpenDirect, log)
	if err != nil {
		return nil, fmt.Errorf("storage: disk tier file %s in DYN_KVBM_DISK_CACHE_DIR=%q cannot be opened: %w", path, dir, err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		_ = unix.Close(fd)
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s", errPersistBusy, path)
		}
		return nil, fmt.Errorf("storage: disk tier file %s: flock: %w", path, err)
	}
	d := &DiskRegion{fd: fd, path: path, direct: odirect, numBlocks: o.NumBlocks, blockBytes: o.BlockBytes,
		stride: stride, slot: slot, payloadAt: HeaderBytes, persistent: true, fp: o.Fingerprint}
	fail := func(err error) (*DiskRegion, error) {
		_ = unix.Close(fd) // the file stays: it may hold blocks worth keeping
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fail(fmt.Errorf("storage: disk tier file %s: fstat: %w", path, err))
	}
	rec := Recovery{Path: path, Reused: st.Size > 0, OldBlocks: int(st.Size / slot), Discarded: map[string]int{}}
	if d.direct && rec.Reused {
		// Read-only probe: a write would destroy block 0.
		if err := d.probeDirectRead(); err != nil {
			log.Warn("kvbm disk tier: O_DIRECT I/O fails on this filesystem, using buffered I/O", "path", path, "err", err)
			if err := d.dropDirect(); err != nil {
				return fail(fmt.Errorf("storage: disk tier file %s: turn O_DIRECT off: %w", path, err))
			}
		}
	}
	if st.Size > size {
		// Blocks past the new end are lost (counted if their header
		// verifies); the rest keep their offsets.
		if n := d.countValid(o.NumBlocks, int((st.Size+slot-1)/slot)); n > 0 {
			rec.Discarded[DiscardBeyondSize] = n
		}
		if err := unix.Ftruncate(fd, size); err != nil {
			return fail(fmt.Errorf("storage: disk tier file %s: shrink to %d bytes: %w", path, size, err))
		}
	}
	if err := d.preallocate(size, o.ZeroFill, log); err != nil {
		return fail(fmt.Errorf("storage: disk tier needs %d bytes (%d blocks × %d B) in DYN_KVBM_DISK_CACHE_DIR=%q: %w "+
			"(free space, or lower DYN_KVBM_DISK_CACHE_GB / DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS)",
			size, o.NumBlocks, slot, dir, err))
	}
	if d.direct && !rec.Reused {
		// A new file has nothing to lose: probe with a write, as a
		// non-persistent tier does.
		if err := probeDirect(d.fd); err != nil {
			log.Warn("kvbm disk tier: O_DIRECT I/O fails on this filesystem, using buffered I/O", "path", path, "err", err)
			if err := d.dropDirect(); err != nil {
				return fail(fmt.Errorf("storage: disk tier file %s: turn O_DIRECT off: %w", path, err))
			}
		}
	}
	d.live = make([]atomic.Bool, o.NumBlocks)
	start := time.Now()
	scanned := 0
	if rec.Reused {
		// A trailing partial slot (a file cut short by something else) is
		// scanned too: its header may still verify, and a slot whose header
		// verifies must be invalidated before it is rewritten.
		scanned = min(int((st.Size+slot-1)/slot), o.NumBlocks)
		d.scan(scanned, &rec)
	}
	rec.Empty += o.NumBlocks - scanned // grown or new: never written
	rec.Duration = time.Since(start)
	d.recovery = rec
	d.hw = newHeaderWriter(d, log)
	resize := "unchanged"
	switch {
	case !rec.Reused:
		resize = "new file"
	case rec.OldBlocks < o.NumBlocks:
		resize = fmt.Sprintf("grown from %d blocks", rec.OldBlocks)
	case rec.OldBlocks > o.NumBlocks:
		resize = fmt.Sprintf("shrunk from %d blocks (the blocks past the new end are dropped)", rec.OldBlocks)
	}
	log.Info("kvbm disk tier ready (persistent)", "path", path, "blocks", o.NumBlocks, "block_bytes", stride,
		"o_direct", d.direct, "size", resize, "recovered_blocks", len(rec.Blocks), "empty_blocks", rec.Empty,
		"discarded_blocks", rec.NumDiscarded(), "discarded_by_reason", fmt.Sprint(rec.Discarded),
		"recovery_seconds", rec.Duration.Seconds())
	return d, nil
}

// listForeignTiers logs the persistent tier files in dir other than ours
// (another model, dtype, layout, TP size or rank). They are never reused
// nor removed: an engine of that fingerprint may come back to them, and
// only an operator knows it will not.
func listForeignTiers(dir, ours string, log *slog.Logger) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(dir, name)
		if !e.Type().IsRegular() || path == ours || !strings.HasPrefix(name, persistPrefix) || !strings.HasSuffix(name, persistSuffix) {
			continue
		}
		var size int64
		if fi, err := e.Info(); err == nil {
			size = fi.Size()
		}
		log.Info("kvbm disk tier: keeping a persistent tier file of another fingerprint (another model, dtype, "+
			"layout or rank; this worker never uses it, remove it to free the space once no engine needs it)",
			"path", path, "bytes", size)
	}
}

// alignedBuf returns n bytes at an Alignment boundary (O_DIRECT buffers).
// Go's collector does not move heap objects, so the address stays valid.
func alignedBuf(n int) []byte {
	b := make([]byte, n+Alignment)
	off := 0
	if r := int(uintptr(unsafe.Pointer(unsafe.SliceData(b))) % Alignment); r != 0 {
		off = Alignment - r
	}
	return b[off : off+n : off+n]
}

var headerBufs = sync.Pool{New: func() any { b := alignedBuf(HeaderBytes); return &b }}

func (d *DiskRegion) probeDirectRead() error {
	bp := headerBufs.Get().(*[]byte)
	defer headerBufs.Put(bp)
	_, err := unix.Pread(d.fd, *bp, 0)
	return err
}

// Persistent reports whether the file outlives the process.
func (d *DiskRegion) Persistent() bool { return d.persistent }

// Recovery is what opening a persistent tier found (zero for other tiers).
func (d *DiskRegion) Recovery() Recovery { return d.recovery }

// encodeHeader fills buf (HeaderBytes) with block i's header.
func (d *DiskRegion) encodeHeader(buf []byte, i int, h *BlockHeader) {
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
	for k, t := range toks {
		le.PutUint32(buf[headerFixed+4*k:], t)
	}
	le.PutUint64(buf[headerSumAt:], xxh3.Hash(buf[:headerSumAt]))
}

// decodeHeader parses block i's header; reason is "" for a valid header,
// "empty" for a slot never written (or invalidated), else a Discard reason.
func (d *DiskRegion) decodeHeader(buf []byte, i int) (h BlockHeader, reason string) {
	le := binary.LittleEndian
	if string(buf[0:8]) != headerMagic {
		for _, c := range buf[:headerFixed] {
			if c != 0 {
				return h, DiscardTorn
			}
		}
		return h, "empty"
	}
	if xxh3.Hash(buf[:headerSumAt]) != le.Uint64(buf[headerSumAt:]) {
		return h, DiscardTorn
	}
	if le.Uint32(buf[8:]) != headerVersion {
		return h, DiscardVersion
	}
	if string(buf[16:32]) != string(d.fp[:]) {
		return h, DiscardFingerprint
	}
	if le.Uint64(buf[32:]) != uint64(i) {
		return h, DiscardMisplaced
	}
	if le.Uint64(buf[64:]) != uint64(d.blockBytes) {
		return h, DiscardLength
	}
	flags := le.Uint32(buf[12:])
	n := int(le.Uint32(buf[60:]))
	if n > MaxHeaderTokens {
		return h, DiscardTorn
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
	return h, ""
}

// scanWorkers reads headers in parallel: on NVMe one 4 KiB read at a time
// leaves the device mostly idle.
const scanWorkers = 8

// scan reads the headers of blocks [0, n) into rec.
func (d *DiskRegion) scan(n int, rec *Recovery) {
	// The headers are 4 KiB reads far apart: read-ahead would pull in the
	// payloads between them.
	_ = unix.Fadvise(d.fd, 0, 0, unix.FADV_RANDOM)
	defer func() { _ = unix.Fadvise(d.fd, 0, 0, unix.FADV_NORMAL) }()
	type result struct {
		blocks    []RecoveredBlock
		empty     int
		discarded map[string]int
	}
	parts := make([]result, scanWorkers)
	var wg sync.WaitGroup
	for w := range scanWorkers {
		wg.Add(1)
		go func() { // joined below
			defer wg.Done()
			r := &parts[w]
			r.discarded = map[string]int{}
			buf := alignedBuf(HeaderBytes)
			for i := w; i < n; i += scanWorkers {
				if err := d.readHeader(i, buf); err != nil {
					r.discarded[DiscardReadError]++
					continue
				}
				h, reason := d.decodeHeader(buf, i)
				switch reason {
				case "":
					r.blocks = append(r.blocks, RecoveredBlock{Index: i, BlockHeader: h})
					d.live[i].Store(true)
				case "empty":
					r.empty++
				default:
					r.discarded[reason]++
				}
			}
		}()
	}
	wg.Wait()
	for _, p := range parts {
		rec.Blocks = append(rec.Blocks, p.blocks...)
		rec.Empty += p.empty
		for k, v := range p.discarded {
			rec.Discarded[k] += v
		}
	}
	// Index order: deterministic, and sequential for whoever reads them next.
	slices.SortFunc(rec.Blocks, func(a, b RecoveredBlock) int { return a.Index - b.Index })
}

// countValid is how many of slots [lo, hi) hold a header that verifies.
func (d *DiskRegion) countValid(lo, hi int) int {
	buf := alignedBuf(HeaderBytes)
	n := 0
	for i := lo; i < hi; i++ {
		if d.readHeader(i, buf) == nil {
			if _, reason := d.decodeHeader(buf, i); reason == "" {
				n++
			}
		}
	}
	return n
}

func (d *DiskRegion) readHeader(i int, buf []byte) error {
	return d.pio(unix.Pread, "read header", i, buf, int64(i)*d.slot)
}

func (d *DiskRegion) writeHeader(i int, buf []byte) error {
	return d.pio(unix.Pwrite, "write header", i, buf, int64(i)*d.slot)
}

// pio runs a full positioned read or write, retrying short transfers.
func (d *DiskRegion) pio(op func(int, []byte, int64) (int, error), what string, i int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := op(d.fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("storage: disk tier %s: %s %d: %w", d.path, what, i, err)
		}
		if n == 0 {
			return fmt.Errorf("storage: disk tier %s: %s %d: no progress", d.path, what, i)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// WriteBlockHeader writes block i's payload from buf (as WriteBlock) and
// then its header h, in the order the file comment describes. h == nil
// writes the payload with no valid header: usable by this process, not
// recovered by the next.
func (d *DiskRegion) WriteBlockHeader(i int, buf []byte, h *BlockHeader) error {
	if !d.persistent {
		return d.WriteBlock(i, buf)
	}
	if err := d.check(i, buf); err != nil {
		return err
	}
	d.hw.wait(i)
	if d.live[i].Load() {
		// One pwritev: the zeroed header, then the payload that follows it
		// in the slot. The kernel copies (or, with O_DIRECT, completes)
		// it in order before the call returns, so no payload byte changes
		// while the old header is still there.
		if err := d.pwritev([][]byte{zeroHeader, buf}, int64(i)*d.slot); err != nil {
			return fmt.Errorf("storage: disk tier %s: write block %d: %w", d.path, i, err)
		}
		d.live[i].Store(false)
	} else if err := d.WriteBlock(i, buf); err != nil {
		return err
	}
	if h == nil {
		return nil
	}
	bp := headerBufs.Get().(*[]byte)
	d.encodeHeader(*bp, i, h)
	if d.hw.enqueue(i, bp) {
		return nil
	}
	defer headerBufs.Put(bp)
	if err := d.writeHeader(i, *bp); err != nil {
		return err
	}
	d.live[i].Store(true)
	return nil
}

// zeroHeader is an aligned, all-zero header: an invalid one.
var zeroHeader = alignedBuf(HeaderBytes)

// pwritev writes iovs at off, retrying short writes.
func (d *DiskRegion) pwritev(iovs [][]byte, off int64) error {
	iovs = slices.Clone(iovs)
	for len(iovs) > 0 {
		n, err := unix.Pwritev(d.fd, iovs, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
		}
		off += int64(n)
		for n > 0 && len(iovs) > 0 {
			if n >= len(iovs[0]) {
				n -= len(iovs[0])
				iovs = iovs[1:]
				continue
			}
			iovs[0] = iovs[0][n:]
			n = 0
		}
	}
	return nil
}

// InvalidateHeader makes block i unrecoverable (its bytes are being
// replaced, or the leader dropped it). A no-op when its header is known
// not to be valid on disk, or the tier is not persistent.
func (d *DiskRegion) InvalidateHeader(i int) error {
	if !d.persistent || i < 0 || i >= d.numBlocks {
		return nil
	}
	d.hw.wait(i)
	if !d.live[i].Load() {
		return nil
	}
	bp := headerBufs.Get().(*[]byte)
	defer headerBufs.Put(bp)
	clear(*bp)
	if err := d.writeHeader(i, *bp); err != nil {
		return err
	}
	d.live[i].Store(false)
	return nil
}
