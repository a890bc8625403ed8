package storage

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/layout"
)

// DiskOptions configures a disk tier file.
type DiskOptions struct {
	Dir        string // DYN_KVBM_DISK_CACHE_DIR; "" means /tmp
	Rank       int    // worker rank, part of the file name
	NumBlocks  int
	BlockBytes int64 // payload per block; the file stride is this rounded up to Alignment
	// DisableODirect forces buffered I/O (DYN_KVBM_DISK_DISABLE_O_DIRECT).
	DisableODirect bool
	// OpenDirect passes O_DIRECT to open (DYN_KVBM_DISK_ALLOCATOR_TYPE=
	// open-direct) rather than setting it with fcntl once the file is
	// open, for filesystems that ignore the latter (IBM Storage Scale).
	OpenDirect bool
	// ZeroFill reserves the file's space by writing zeros where fallocate
	// is unsupported (DYN_KVBM_DISK_ZEROFILL_FALLBACK); otherwise the file
	// is left sparse there.
	ZeroFill bool
	// Persist keeps the file across restarts under a name derived from
	// Fingerprint and Rank, with a header per block (persist.go).
	Persist     bool
	Fingerprint fingerprint.Fingerprint
	// Key authenticates a persistent tier's blocks (integrity.LocalKey):
	// blocks whose MACs do not verify under it are not recovered.
	Key    integrity.Key
	Logger *slog.Logger
}

// DiskRegion is the disk tier: one preallocated file, block i at offset
// i × Stride. It is safe for concurrent ReadBlock/WriteBlock calls on
// different blocks.
type DiskRegion struct {
	fd         int
	path       string
	direct     bool
	numBlocks  int
	blockBytes int64
	stride     int64 // I/O size of a payload (blockBytes aligned up)
	slot       int64 // distance between blocks: stride, plus HeaderBytes when persistent
	payloadAt  int64 // payload offset within a slot: HeaderBytes when persistent (the header comes first)

	// Persistent tiers only (persist.go).
	persistent bool
	fp         fingerprint.Fingerprint
	key        integrity.Key
	recovery   Recovery
	live       []atomic.Bool                  // block's header may verify on disk: invalidate before rewriting
	claims     []atomic.Pointer[payloadClaim] // recovered blocks not rewritten since: payload MAC to check
	hw         *headerWriter
}

// probeDirect checks that O_DIRECT I/O really works on fd; some filesystems
// accept the open flag and fail every I/O. A variable so tests can make it fail.
var probeDirect = func(fd int) error {
	page, err := mapAnon(Alignment, false)
	if err != nil {
		return err
	}
	defer func() { _ = unix.Munmap(page) }()
	if _, err := unix.Pwrite(fd, page, 0); err != nil {
		return err
	}
	_, err = unix.Pread(fd, page, 0)
	return err
}

// NewDiskRegion creates and preallocates the disk tier file.
func NewDiskRegion(o DiskOptions) (*DiskRegion, error) {
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	if o.NumBlocks <= 0 || o.BlockBytes <= 0 {
		return nil, fmt.Errorf("storage: disk tier: %d blocks of %d bytes: both must be > 0", o.NumBlocks, o.BlockBytes)
	}
	dir := o.Dir
	if o.Persist {
		// A file in a directory others can write could be theirs.
		if err := CheckPersistDir(dir); err != nil {
			return nil, err
		}
	} else {
		if dir == "" {
			dir = "/tmp/"
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("storage: disk tier directory DYN_KVBM_DISK_CACHE_DIR=%q cannot be created: %w", dir, err)
		}
	}
	removeStaleFiles(dir, log)
	if o.Persist {
		d, err := openPersistent(o, dir, log)
		if !errors.Is(err, errPersistBusy) {
			return d, err
		}
		log.Warn("kvbm disk tier: the persistent tier file is held by another live process; "+
			"this process uses a fresh file that is removed at exit", "err", err)
	}
	stride := layout.AlignUp(o.BlockBytes, Alignment)
	size := stride * int64(o.NumBlocks)
	if size/int64(o.NumBlocks) != stride {
		return nil, fmt.Errorf("storage: disk tier: %d blocks × %d bytes overflows", o.NumBlocks, stride)
	}
	d := &DiskRegion{fd: -1, numBlocks: o.NumBlocks, blockBytes: o.BlockBytes, stride: stride, slot: stride}
	if err := d.create(dir, o.Rank, !o.DisableODirect, o.OpenDirect, log); err != nil {
		return nil, err
	}
	if err := d.preallocate(size, o.ZeroFill, log); err != nil {
		_ = d.Close()
		return nil, fmt.Errorf("storage: disk tier needs %d bytes (%d blocks × %d B) in DYN_KVBM_DISK_CACHE_DIR=%q: %w "+
			"(free space, or lower DYN_KVBM_DISK_CACHE_GB / DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS)",
			size, o.NumBlocks, stride, dir, err)
	}
	if d.direct {
		if err := probeDirect(d.fd); err != nil {
			log.Warn("kvbm disk tier: O_DIRECT I/O fails on this filesystem, using buffered I/O", "path", d.path, "err", err)
			if err := d.dropDirect(); err != nil {
				path := d.path
				_ = d.Close()
				return nil, fmt.Errorf("storage: disk tier file %s: turn O_DIRECT off: %w", path, err)
			}
		}
	}
	log.Info("kvbm disk tier ready", "path", d.path, "blocks", o.NumBlocks, "block_bytes", stride, "o_direct", d.direct)
	return d, nil
}

// fallocate is unix.Fallocate; a variable so tests can make the filesystem
// refuse it.
var fallocate = unix.Fallocate

// preallocate reserves size bytes for the file. Where the filesystem has no
// fallocate (EOPNOTSUPP: Lustre, some network filesystems), zeroFill writes
// zeros instead; otherwise the file is only extended, sparse.
func (d *DiskRegion) preallocate(size int64, zeroFill bool, log *slog.Logger) error {
	err := fallocate(d.fd, 0, 0, size)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("fallocate: %w", err) // errprefix: wrapped by NewDiskRegion and openPersistent
	}
	if zeroFill {
		log.Warn("kvbm disk tier: fallocate not supported, reserving the space by writing zeros "+
			"(DYN_KVBM_DISK_ZEROFILL_FALLBACK)", "path", d.path, "bytes", size, "err", err)
		if err := d.zeroFill(size); err != nil {
			return fmt.Errorf("zero-fill (DYN_KVBM_DISK_ZEROFILL_FALLBACK): %w", err) // errprefix: wrapped by NewDiskRegion and openPersistent
		}
		return nil
	}
	// The filesystem cannot reserve space up front; a sparse file still
	// works, and a full disk then shows up as a write error at runtime,
	// which the worker turns into a degraded (G2-only) tier.
	log.Warn("kvbm disk tier: fallocate not supported, using a sparse file (space is not reserved; "+
		"set DYN_KVBM_DISK_ZEROFILL_FALLBACK to write zeros instead)", "path", d.path, "err", err)
	if err := unix.Ftruncate(d.fd, size); err != nil {
		return fmt.Errorf("ftruncate: %w", err) // errprefix: wrapped by NewDiskRegion and openPersistent
	}
	return nil
}

// zeroFillChunk is the largest zero-fill write (Dynamo's, 16 MiB).
const zeroFillChunk = 16 << 20

// zeroFill extends the file to size by writing zeros from its current end,
// so that every byte is allocated (a write to a full disk fails here, at
// start-up, rather than at the first offload). The buffer is page-aligned
// and every write starts and ends on an Alignment boundary, as O_DIRECT
// requires: the last one is rounded up to a page and the file is then cut
// back to size. Bytes already in the file are kept (a persistent tier may
// hold blocks): an unaligned end is first read back into the buffer.
//
// errprefix: its errors are wrapped by preallocate's callers.
func (d *DiskRegion) zeroFill(size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		return fmt.Errorf("fstat: %w", err)
	}
	if st.Size >= size {
		return nil
	}
	off := st.Size - st.Size%Alignment
	buf, err := mapAnon(min(zeroFillChunk, layout.AlignUp(size-off, Alignment)), false)
	if err != nil {
		return err
	}
	defer func() { _ = unix.Munmap(buf) }()
	if keep := int(st.Size - off); keep > 0 {
		if err := preadFull(d.fd, buf[:Alignment], off); err != nil {
			return fmt.Errorf("read the last page back: %w", err)
		}
		clear(buf[keep:Alignment])
	}
	for first := true; off < size; first = false {
		n := min(int64(len(buf)), layout.AlignUp(size-off, Alignment))
		if err := pwriteFull(d.fd, buf[:n], off); err != nil {
			return fmt.Errorf("write zeros at %d: %w", off, err)
		}
		if first {
			clear(buf[:Alignment]) // it held the kept bytes
		}
		off += n
	}
	if off > size {
		if err := unix.Ftruncate(d.fd, size); err != nil {
			return fmt.Errorf("ftruncate to %d: %w", size, err)
		}
	}
	return nil
}

// pwriteFull writes all of buf at off.
func pwriteFull(fd int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := unix.Pwrite(fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// preadFull reads up to len(buf) bytes at off; past the end of the file the
// rest of buf is left as it was.
func preadFull(fd int, buf []byte, off int64) error {
	for len(buf) > 0 {
		n, err := unix.Pread(fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// create makes the tier file under a fresh name and takes its lock. A
// cleanup in another process may lock and remove the file between our open
// and our flock (it is not locked yet, so it looks stale); create then sees
// the lock taken, or its path gone, and tries again under another name.
func (d *DiskRegion) create(dir string, rank int, direct, atOpen bool, log *slog.Logger) error {
	const attempts = 3
	for range attempts {
		var rnd [4]byte
		_, _ = rand.Read(rnd[:])
		path := filepath.Join(dir, fmt.Sprintf(diskFilePrefix+"%d-rank%d-%s", os.Getpid(), rank, hex.EncodeToString(rnd[:])))
		fd, odirect, err := openTierFile(path, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW, direct, atOpen, log)
		if err != nil {
			return fmt.Errorf("storage: disk tier file %s in DYN_KVBM_DISK_CACHE_DIR=%q cannot be created: %w", path, dir, err)
		}
		if err := lockTierFile(fd, path); err != nil {
			_ = unix.Close(fd)
			if errors.Is(err, errLostToCleanup) {
				continue
			}
			return fmt.Errorf("storage: disk tier file %s: %w", path, err)
		}
		d.fd, d.path, d.direct = fd, path, odirect
		return nil
	}
	return fmt.Errorf("storage: disk tier in DYN_KVBM_DISK_CACHE_DIR=%q: %w %d times", dir, errLostToCleanup, attempts)
}

// errLostToCleanup: another process's stale-file cleanup removed the file
// we had just created, before we could lock it.
var errLostToCleanup = errors.New("new file removed by a concurrent cleanup before it was locked") // errprefix: wrapped by create

// openFile is unix.Open; a variable so tests can see the flags.
var openFile = unix.Open

// openTierFile opens path read-write with the extra open flags
// (O_CREAT|O_EXCL|O_NOFOLLOW for a fresh file, O_NOFOLLOW to reopen a
// persistent one).
// With direct, it turns O_DIRECT on: as Dynamo does, with fcntl once the
// file is open, or with atOpen in the open call itself. A filesystem that
// refuses O_DIRECT (EINVAL) leaves the file buffered, with a warning; the
// result says whether O_DIRECT is on.
//
// errprefix: its errors are wrapped by create and openPersistent.
func openTierFile(path string, extra int, direct, atOpen bool, log *slog.Logger) (fd int, odirect bool, err error) {
	baseFlags := unix.O_RDWR | unix.O_CLOEXEC | extra
	if direct && atOpen {
		fd, err = openFile(path, baseFlags|unix.O_DIRECT, 0o600)
		if err == nil {
			return fd, true, nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return -1, false, err
		}
		log.Warn("kvbm disk tier: filesystem refuses O_DIRECT at open (DYN_KVBM_DISK_ALLOCATOR_TYPE=open-direct), "+
			"using buffered I/O", "path", path, "err", err)
		direct = false
	}
	fd, err = openFile(path, baseFlags, 0o600)
	if err != nil {
		return -1, false, err
	}
	if !direct {
		return fd, false, nil
	}
	if err := setDirect(fd, true); err != nil {
		if errors.Is(err, unix.EINVAL) {
			log.Warn("kvbm disk tier: filesystem refuses O_DIRECT, using buffered I/O", "path", path, "err", err)
			return fd, false, nil
		}
		_ = unix.Close(fd)
		return -1, false, fmt.Errorf("set O_DIRECT: %w", err)
	}
	return fd, true, nil
}

// setDirect turns O_DIRECT on or off on fd's open file description.
func setDirect(fd int, on bool) error {
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return err
	}
	if on {
		flags |= unix.O_DIRECT
	} else {
		flags &^= unix.O_DIRECT
	}
	_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, flags)
	return err
}

// lockTierFile takes the exclusive lock that marks the file as in use for
// its whole lifetime, and checks that path still names the locked file.
func lockTierFile(fd int, path string) error {
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return errLostToCleanup // a cleanup holds it while removing it
		}
		return fmt.Errorf("flock: %w", err) // errprefix: wrapped by create
	}
	var held, named unix.Stat_t
	if err := unix.Fstat(fd, &held); err != nil {
		return fmt.Errorf("fstat: %w", err) // errprefix: wrapped by create
	}
	if err := unix.Stat(path, &named); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return errLostToCleanup
		}
		return fmt.Errorf("stat: %w", err) // errprefix: wrapped by create
	}
	if held.Dev != named.Dev || held.Ino != named.Ino {
		return errLostToCleanup
	}
	return nil
}

// dropDirect turns O_DIRECT off. It changes the flags of the open file
// description rather than opening the file again: the lock belongs to this
// description, and a second one could not take it while the first holds it.
func (d *DiskRegion) dropDirect() error {
	if err := setDirect(d.fd, false); err != nil {
		return err
	}
	d.direct = false
	return nil
}

// Path is the file's path (tests corrupt it on purpose).
func (d *DiskRegion) Path() string { return d.path }

// Direct reports whether I/O bypasses the page cache.
func (d *DiskRegion) Direct() bool { return d.direct }

// NumBlocks is the number of blocks in the file.
func (d *DiskRegion) NumBlocks() int { return d.numBlocks }

// BlockBytes is the payload size of one block.
func (d *DiskRegion) BlockBytes() int64 { return d.blockBytes }

// Stride is the size of every payload I/O (BlockBytes aligned up).
func (d *DiskRegion) Stride() int64 { return d.stride }

func (d *DiskRegion) check(i int, buf []byte) error {
	if i < 0 || i >= d.numBlocks {
		return fmt.Errorf("storage: disk block %d out of range [0, %d)", i, d.numBlocks)
	}
	if int64(len(buf)) != d.stride {
		return fmt.Errorf("storage: disk block %d: buffer of %d bytes, want the stride %d", i, len(buf), d.stride)
	}
	if d.direct && uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%Alignment != 0 {
		return fmt.Errorf("storage: disk block %d: buffer not %d-aligned for O_DIRECT", i, Alignment)
	}
	return nil
}

// WriteBlock writes block i from buf, which must be Stride bytes long and,
// with O_DIRECT, Alignment-aligned (HostRegion.IOBlock is).
func (d *DiskRegion) WriteBlock(i int, buf []byte) error {
	if err := d.check(i, buf); err != nil {
		return err
	}
	off := int64(i)*d.slot + d.payloadAt
	for len(buf) > 0 {
		n, err := unix.Pwrite(d.fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("storage: disk tier %s: write block %d: %w", d.path, i, err)
		}
		if n == 0 {
			return fmt.Errorf("storage: disk tier %s: write block %d: %w", d.path, i, io.ErrShortWrite)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// ReadBlock reads block i into buf (same requirements as WriteBlock).
func (d *DiskRegion) ReadBlock(i int, buf []byte) error {
	if err := d.check(i, buf); err != nil {
		return err
	}
	off := int64(i)*d.slot + d.payloadAt
	for len(buf) > 0 {
		n, err := unix.Pread(d.fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("storage: disk tier %s: read block %d: %w", d.path, i, err)
		}
		if n == 0 {
			return fmt.Errorf("storage: disk tier %s: read block %d: %w", d.path, i, io.ErrUnexpectedEOF)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// Close removes and closes the file; a persistent tier's file is kept
// instead, after its queued headers are written and fdatasync. The file is
// removed while its lock is still held, so no cleanup elsewhere can see it
// unlocked. A crashed process
// leaves its file behind, unlocked (the kernel drops the lock with the last
// descriptor); the pid in the name tells an operator whose it was.
func (d *DiskRegion) Close() error {
	var errs []error
	path := d.path
	if d.hw != nil && d.fd >= 0 {
		d.hw.close() // queued headers first: they are part of what is kept
	}
	if d.persistent && d.fd >= 0 {
		// The file stays for the next process; what was written reaches
		// the device before the lock goes.
		if err := unix.Fdatasync(d.fd); err != nil {
			errs = append(errs, fmt.Errorf("storage: disk tier %s: fdatasync: %w", path, err))
		}
	}
	if path != "" && !d.persistent {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("storage: disk tier %s: remove: %w", path, err))
		}
		d.path = ""
	}
	if d.fd >= 0 {
		if err := unix.Close(d.fd); err != nil {
			errs = append(errs, fmt.Errorf("storage: disk tier %s: close: %w", path, err))
		}
		d.fd = -1
	}
	return errors.Join(errs...)
}

// diskFilePrefix starts every disk tier file name: kvbm-disk-cache-<pid>-rank<r>-<random>.
const diskFilePrefix = "kvbm-disk-cache-"

// removeStaleFiles deletes disk tier files in dir that no process has open
// (a crash skips Close, which removes the file). Their contents are useless:
// the registry that indexed them died with the process.
//
// A live tier holds an exclusive flock on its file (see lockTierFile), so a
// file whose lock can be taken is stale. The pid in the name is not used:
// processes in other PID namespaces (containers sharing a volume) have pids
// that mean nothing here, and a pid can be reused.
func removeStaleFiles(dir string, log *slog.Logger) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		name := e.Name()
		if !e.Type().IsRegular() || !strings.HasPrefix(name, diskFilePrefix) {
			continue
		}
		path := filepath.Join(dir, name)
		if removeIfUnlocked(path) {
			log.Info("kvbm disk tier: removed a file that no process holds", "path", path)
		}
	}
}

// removeIfUnlocked removes path if its lock can be taken, holding the lock
// while it removes it. Another user's file is kept (in a shared directory
// such as /tmp it is not ours to judge).
func removeIfUnlocked(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer func() { _ = unix.Close(fd) }()
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || int(st.Uid) != os.Geteuid() {
		return false
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return false
	}
	return os.Remove(path) == nil
}
