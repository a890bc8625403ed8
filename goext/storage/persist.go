package storage

// Persistent disk tier (DYN_KVBM_DISK_PERSIST, docs/persistent-g3.md).
//
// File: <dir>/kvbm-g3-<fingerprint>-rank<r>.tier, block i at offset i × slot,
// slot = HeaderBytes + Stride: one HeaderBytes sector describing the block,
// then its payload (aligned up). The header names the fingerprint, the
// block's index, its sequence hash, parent, priority and tokens, the payload
// length, XXH3 and MAC, and ends with its own MAC and XXH3
// (persist_headers.go).
//
// Trust: the directory must not be writable by group or others, the file is
// created with O_EXCL|O_NOFOLLOW and an existing one is used only if it is a
// regular file of this user with one link, not writable by group or others
// (openPersistentFile). Even so only authenticated blocks are recovered: a
// header whose MAC does not verify under the tier's key is discarded, and a
// recovered block's payload is checked against its MAC when it is first
// loaded (VerifyRecovered).
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
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/layout"
)

// HeaderBytes is the size of one block header in a persistent tier file.
const HeaderBytes = 4096

const (
	persistPrefix = "kvbm-g3-"
	persistSuffix = ".tier"
	headerMagic   = "KVBMG3H\x01"
	// headerVersion 2 added the MACs; a file of version 1 is reinitialised.
	headerVersion = 2
	// Fixed fields (headerFields in persist_headers.go), tokens follow.
	headerFixed = 120
	// headerSumAt is where the header's own XXH3 (over bytes [0, headerSumAt)) sits.
	headerSumAt = HeaderBytes - 8
	// MaxHeaderTokens is how many tokens a header carries; a block with
	// more is persisted without its tokens.
	MaxHeaderTokens = (headerMACAt - headerFixed) / 4

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

	// payloadMAC is the recorded MAC of a recovered block's payload.
	payloadMAC [integrity.SealSize]byte
}

// RecoveredBlock is one block whose header verified at start.
type RecoveredBlock struct {
	Index int
	BlockHeader
}

// Discard reasons in Recovery.Discarded.
const (
	DiscardTorn    = "torn_header"    // bad magic or header checksum: a write was interrupted
	DiscardVersion = "header_version" // written by another format version (the file is reinitialised)
	// DiscardUnauthenticated: the header's MAC does not verify under this
	// tier's key: written by someone without the key, or under another
	// secret (DYN_KVBM_STORAGE_SECRET changed).
	DiscardUnauthenticated = "unauthenticated"
	DiscardFingerprint     = "fingerprint"    // header of another fingerprint (copied file)
	DiscardMisplaced       = "misplaced"      // header names another block index
	DiscardLength          = "payload_length" // header for another payload size
	DiscardReadError       = "read_error"     // the header could not be read
)

// Recovery is what opening a persistent tier found.
type Recovery struct {
	Path      string
	Reused    bool // an existing file was opened (false: created)
	OldBlocks int  // blocks the file held before resizing (0: new file)
	Blocks    []RecoveredBlock
	Empty     int            // slots never written (or invalidated)
	Discarded map[string]int // reason → blocks
	// HeadersRead is how many slot headers were read: never more than the
	// configured block count, whatever the file's size.
	HeadersRead int
	// Reinitialised: the file was of an older format version and was
	// emptied (its blocks are not recovered).
	Reinitialised bool
	Duration      time.Duration
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
	if !o.Key.Valid() {
		return nil, errors.New("storage: persistent disk tier (DYN_KVBM_DISK_PERSIST): no key to authenticate its blocks")
	}
	stride := layout.AlignUp(o.BlockBytes, Alignment)
	slot := stride + HeaderBytes
	size := slot * int64(o.NumBlocks)
	if size/int64(o.NumBlocks) != slot {
		return nil, fmt.Errorf("storage: disk tier: %d blocks × %d bytes overflows", o.NumBlocks, slot)
	}
	path := PersistentPath(dir, o.Fingerprint, o.Rank)
	listForeignTiers(dir, path, log)
	fd, odirect, err := openPersistentFile(path, !o.DisableODirect, o.OpenDirect, log)
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
		stride: stride, slot: slot, payloadAt: HeaderBytes, persistent: true, fp: o.Fingerprint, key: o.Key}
	fail := func(err error) (*DiskRegion, error) {
		_ = unix.Close(fd) // the file stays: it may hold blocks worth keeping
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fail(fmt.Errorf("storage: disk tier file %s: fstat: %w", path, err))
	}
	rec := Recovery{Path: path, Reused: st.Size > 0, OldBlocks: int(min(st.Size/slot, math.MaxInt32)), Discarded: map[string]int{}}
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
		// The blocks past the new end are dropped unread: what start-up
		// reads is bounded by the configured tier, not by the file (a huge
		// sparse file would otherwise take hours to scan).
		log.Info("kvbm disk tier: the persistent tier file is larger than the configured tier; it is cut to size "+
			"and the blocks past the new end are dropped", "path", path, "file_bytes", st.Size, "bytes", size,
			"blocks", o.NumBlocks)
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
	d.claims = make([]atomic.Pointer[payloadClaim], o.NumBlocks)
	start := time.Now()
	scanned := 0
	if rec.Reused {
		// A trailing partial slot (a file cut short by something else) is
		// scanned too: its header may still verify, and a slot whose header
		// verifies must be invalidated before it is rewritten.
		scanned = min(int((min(st.Size, size)+slot-1)/slot), o.NumBlocks)
		d.scan(scanned, &rec)
	}
	rec.Empty += o.NumBlocks - scanned // grown or new: never written
	if rec.Discarded[DiscardVersion] > 0 {
		if err := d.reinitialise(size, o.ZeroFill, &rec, log); err != nil {
			return fail(err)
		}
	}
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
		"mac_key", o.Key.Source(), "recovery_seconds", rec.Duration.Seconds())
	if n := rec.Discarded[DiscardUnauthenticated]; n > 0 {
		log.Warn("kvbm disk tier: blocks whose MAC does not verify under this tier's key were not recovered "+
			"(written without the key, or under another DYN_KVBM_STORAGE_SECRET)", "path", path, "blocks", n,
			"mac_key", o.Key.Source())
	}
	return d, nil
}

// reinitialise empties a file written by an older format version: its
// blocks cannot be authenticated, so none is recovered (those of the
// current version found with them are dropped too: such a mix is not
// something kvbm writes).
func (d *DiskRegion) reinitialise(size int64, zeroFill bool, rec *Recovery, log *slog.Logger) error {
	log.Warn("kvbm disk tier: the persistent tier file was written by an older format version (no MACs); "+
		"its blocks are not recovered and the file is reinitialised", "path", d.path,
		"old_version_blocks", rec.Discarded[DiscardVersion])
	rec.Discarded[DiscardVersion] += len(rec.Blocks)
	rec.Blocks = nil
	rec.Empty = d.numBlocks
	rec.Reinitialised = true
	for i := range d.live {
		d.live[i].Store(false)
		d.claims[i].Store(nil)
	}
	if err := unix.Ftruncate(d.fd, 0); err != nil {
		return fmt.Errorf("storage: disk tier file %s: reinitialise: %w", d.path, err)
	}
	if err := d.preallocate(size, zeroFill, log); err != nil {
		return fmt.Errorf("storage: disk tier file %s: reinitialise: %w", d.path, err)
	}
	return nil
}

// openPersistentFile opens the tier file at path, or creates it (O_EXCL).
// Neither follows a symlink, and an existing file is used only if it is a
// regular file of this user with one link that group and others cannot
// write (integrity.CheckOwnFile): a file planted by someone else is refused.
//
// errprefix: its errors are wrapped by openPersistent.
func openPersistentFile(path string, direct, atOpen bool, log *slog.Logger) (fd int, odirect bool, err error) {
	for range 2 {
		fd, odirect, err = openTierFile(path, unix.O_NOFOLLOW, direct, atOpen, log)
		if errors.Is(err, unix.ENOENT) {
			fd, odirect, err = openTierFile(path, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW, direct, atOpen, log)
			if errors.Is(err, unix.EEXIST) {
				continue // created by another process in between: check it as an existing file
			}
		}
		if err != nil {
			if errors.Is(err, unix.ELOOP) {
				return -1, false, fmt.Errorf("%w: %s is a symlink", integrity.ErrUnsafe, path)
			}
			return -1, false, err
		}
		if err := checkOwnFD(fd, path); err != nil {
			_ = unix.Close(fd)
			return -1, false, err
		}
		return fd, odirect, nil
	}
	return -1, false, err
}

// checkOwnFD is integrity.CheckOwnFile on a descriptor (through a
// duplicate: an *os.File closes its descriptor).
//
// errprefix: integrity's errors, wrapped by openPersistent.
func checkOwnFD(fd int, path string) error {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("dup: %w", err)
	}
	f := os.NewFile(uintptr(dup), path)
	defer f.Close()
	return integrity.CheckOwnFile(f)
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
		read      int
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
				r.read++
				if err := d.readHeader(i, buf); err != nil {
					r.discarded[DiscardReadError]++
					continue
				}
				h, mac, reason := d.decodeHeader(buf, i)
				switch reason {
				case "":
					h.payloadMAC = mac
					r.blocks = append(r.blocks, RecoveredBlock{Index: i, BlockHeader: h})
					d.claims[i].Store(&payloadClaim{seq: h.SeqHash, parent: h.Parent, hasParent: h.HasParent, mac: mac})
					d.live[i].Store(true)
				case "empty":
					r.empty++
				case DiscardUnauthenticated:
					// Whole, but not ours: it might verify under another
					// key (a secret restored later), so it is zeroed
					// before the slot is rewritten, like a valid one.
					d.live[i].Store(true)
					r.discarded[reason]++
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
		rec.HeadersRead += p.read
		for k, v := range p.discarded {
			rec.Discarded[k] += v
		}
	}
	// Index order: deterministic, and sequential for whoever reads them next.
	slices.SortFunc(rec.Blocks, func(a, b RecoveredBlock) int { return a.Index - b.Index })
}

// payloadClaim is what a recovered block's authenticated header says of
// its payload, kept until the block is first rewritten or invalidated.
type payloadClaim struct {
	seq, parent uint64
	hasParent   bool
	mac         [integrity.SealSize]byte
}

// ErrUnauthenticated: a recovered block's payload does not match the MAC
// its header records (changed on disk, or moved from another block).
var ErrUnauthenticated = errors.New("storage: disk block payload does not verify against its MAC")

// VerifyRecovered checks payload (at least BlockBytes) read from block i
// against the MAC recorded in its header at recovery. It returns nil for a
// block written by this process, or recovered and verified already: from
// then on the payload checksum in memory (authenticated with the header) is
// what a load checks, as for the blocks this process wrote. It returns
// ErrUnauthenticated for a recovered payload that does not verify.
func (d *DiskRegion) VerifyRecovered(i int, payload []byte) error {
	if !d.persistent || i < 0 || i >= len(d.claims) {
		return nil
	}
	c := d.claims[i].Load()
	if c == nil {
		return nil
	}
	if int64(len(payload)) < d.blockBytes {
		return fmt.Errorf("storage: disk block %d: %d bytes to verify, want %d", i, len(payload), d.blockBytes)
	}
	if !d.payloadVerifies(i, &BlockHeader{SeqHash: c.seq, Parent: c.parent, HasParent: c.hasParent}, payload, c.mac[:]) {
		return fmt.Errorf("%w: block %d of %s", ErrUnauthenticated, i, d.path)
	}
	d.claims[i].CompareAndSwap(c, nil)
	return nil
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
	d.claims[i].Store(nil) // what it recorded of the old payload no longer holds
	// The payload's MAC is computed while its write is in flight (an
	// O_DIRECT write leaves this CPU idle): with few writes in flight a
	// block then takes the longer of the two rather than their sum. buf is
	// only read by both.
	var macc chan [integrity.SealSize]byte
	if h != nil {
		macc = make(chan [integrity.SealSize]byte, 1)
		go func() { macc <- d.payloadMAC(i, h, buf) }() // received below on every path
	}
	if err := d.writePayload(i, buf); err != nil {
		if macc != nil {
			<-macc // buf is the caller's again once this returns
		}
		return err
	}
	if h == nil {
		return nil
	}
	mac := <-macc
	bp := headerBufs.Get().(*[]byte)
	d.encodeHeader(*bp, i, h, &mac)
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

// writePayload writes block i's payload, zeroing its header in the same
// pwritev when that header may be valid on disk.
func (d *DiskRegion) writePayload(i int, buf []byte) error {
	if !d.live[i].Load() {
		return d.WriteBlock(i, buf)
	}
	// One pwritev: the zeroed header, then the payload that follows it in
	// the slot. The kernel copies (or, with O_DIRECT, completes) it in
	// order before the call returns, so no payload byte changes while the
	// old header is still there.
	if err := d.pwritev([][]byte{zeroHeader, buf}, int64(i)*d.slot); err != nil {
		return fmt.Errorf("storage: disk tier %s: write block %d: %w", d.path, i, err)
	}
	d.live[i].Store(false)
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
	d.claims[i].Store(nil)
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

// CheckPersistDir prepares dir for a persistent tier: a directory that
// does not exist is created private to this user (0700); an existing one
// must belong to this user (or root) and must not be writable by group or
// others. A shared directory is refused even with the sticky bit (/tmp):
// another user there can create the tier file first, or the directory
// kvbm would make inside it.
func CheckPersistDir(dir string) error {
	if dir == "" {
		return errors.New("storage: persistent disk tier (DYN_KVBM_DISK_PERSIST): no directory (DYN_KVBM_DISK_CACHE_DIR)")
	}
	fi, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		if err := integrity.PrivateDir(dir); err != nil {
			return fmt.Errorf("storage: persistent disk tier directory DYN_KVBM_DISK_CACHE_DIR=%q: %w", dir, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("storage: persistent disk tier directory DYN_KVBM_DISK_CACHE_DIR=%q: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("storage: persistent disk tier directory DYN_KVBM_DISK_CACHE_DIR=%q is not a directory", dir)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("storage: DYN_KVBM_DISK_CACHE_DIR=%q has mode %v: other users can write there, so a "+
			"persistent tier (DYN_KVBM_DISK_PERSIST) could recover their files; use a private subdirectory "+
			"(mkdir -m 700 %s), or unset DYN_KVBM_DISK_CACHE_DIR for the default $XDG_CACHE_HOME/kvbm (%w)",
			dir, fi.Mode(), filepath.Join(dir, "kvbm-"+userName()), integrity.ErrUnsafe)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() && st.Uid != 0 {
		return fmt.Errorf("storage: DYN_KVBM_DISK_CACHE_DIR=%q belongs to uid %d, not this user (uid %d) nor root; "+
			"a persistent tier (DYN_KVBM_DISK_PERSIST) needs a directory of its own (%w)", dir,
			st.Uid, os.Geteuid(), integrity.ErrUnsafe)
	}
	return nil
}

// userName names this user for a suggested directory.
func userName() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return strconv.Itoa(os.Geteuid())
}
