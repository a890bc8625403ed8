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
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

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
	Logger         *slog.Logger
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
	stride     int64
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
		return nil, fmt.Errorf("disk tier: %d blocks of %d bytes: both must be > 0", o.NumBlocks, o.BlockBytes)
	}
	dir := o.Dir
	if dir == "" {
		dir = "/tmp/"
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("disk tier directory DYN_KVBM_DISK_CACHE_DIR=%q cannot be created: %w", dir, err)
	}
	removeStaleFiles(dir, log)
	stride := layout.AlignUp(o.BlockBytes, Alignment)
	size := stride * int64(o.NumBlocks)
	if size/int64(o.NumBlocks) != stride {
		return nil, fmt.Errorf("disk tier: %d blocks × %d bytes overflows", o.NumBlocks, stride)
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	path := filepath.Join(dir, fmt.Sprintf(diskFilePrefix+"%d-rank%d-%s", os.Getpid(), o.Rank, hex.EncodeToString(rnd[:])))

	d := &DiskRegion{fd: -1, path: path, numBlocks: o.NumBlocks, blockBytes: o.BlockBytes, stride: stride}
	const baseFlags = unix.O_RDWR | unix.O_CREAT | unix.O_EXCL | unix.O_CLOEXEC
	fd, err := -1, error(nil)
	if !o.DisableODirect {
		fd, err = unix.Open(path, baseFlags|unix.O_DIRECT, 0o600)
		if err == nil {
			d.direct = true
		} else if errors.Is(err, unix.EINVAL) {
			log.Warn("kvbm disk tier: filesystem refuses O_DIRECT at open, using buffered I/O", "path", path, "err", err)
		} else {
			return nil, fmt.Errorf("disk tier file %s in DYN_KVBM_DISK_CACHE_DIR=%q cannot be created: %w", path, dir, err)
		}
	}
	if fd < 0 {
		if fd, err = unix.Open(path, baseFlags, 0o600); err != nil {
			return nil, fmt.Errorf("disk tier file %s in DYN_KVBM_DISK_CACHE_DIR=%q cannot be created: %w", path, dir, err)
		}
	}
	d.fd = fd
	if err := d.preallocate(size, log); err != nil {
		_ = d.Close()
		return nil, fmt.Errorf("disk tier needs %d bytes (%d blocks × %d B) in DYN_KVBM_DISK_CACHE_DIR=%q: %w "+
			"(free space, or lower DYN_KVBM_DISK_CACHE_GB / DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS)",
			size, o.NumBlocks, stride, dir, err)
	}
	if d.direct {
		if err := probeDirect(d.fd); err != nil {
			log.Warn("kvbm disk tier: O_DIRECT I/O fails on this filesystem, using buffered I/O", "path", path, "err", err)
			if err := d.reopenBuffered(); err != nil {
				_ = d.Close()
				return nil, fmt.Errorf("disk tier file %s: reopen without O_DIRECT: %w", path, err)
			}
		}
	}
	log.Info("kvbm disk tier ready", "path", path, "blocks", o.NumBlocks, "block_bytes", stride, "o_direct", d.direct)
	return d, nil
}

func (d *DiskRegion) preallocate(size int64, log *slog.Logger) error {
	err := unix.Fallocate(d.fd, 0, 0, size)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("fallocate: %w", err)
	}
	// The filesystem cannot reserve space up front; a sparse file still
	// works, and a full disk then shows up as a write error at runtime,
	// which the worker turns into a degraded (G2-only) tier.
	log.Warn("kvbm disk tier: fallocate not supported, using a sparse file (space is not reserved)", "path", d.path, "err", err)
	if err := unix.Ftruncate(d.fd, size); err != nil {
		return fmt.Errorf("ftruncate: %w", err)
	}
	return nil
}

func (d *DiskRegion) reopenBuffered() error {
	fd, err := unix.Open(d.path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	_ = unix.Close(d.fd)
	d.fd, d.direct = fd, false
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

// Stride is the size of every I/O and the distance between blocks in the file.
func (d *DiskRegion) Stride() int64 { return d.stride }

func (d *DiskRegion) check(i int, buf []byte) error {
	if i < 0 || i >= d.numBlocks {
		return fmt.Errorf("disk block %d out of range [0, %d)", i, d.numBlocks)
	}
	if int64(len(buf)) != d.stride {
		return fmt.Errorf("disk block %d: buffer of %d bytes, want the stride %d", i, len(buf), d.stride)
	}
	if d.direct && uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%Alignment != 0 {
		return fmt.Errorf("disk block %d: buffer not %d-aligned for O_DIRECT", i, Alignment)
	}
	return nil
}

// WriteBlock writes block i from buf, which must be Stride bytes long and,
// with O_DIRECT, Alignment-aligned (HostRegion.IOBlock is).
func (d *DiskRegion) WriteBlock(i int, buf []byte) error {
	if err := d.check(i, buf); err != nil {
		return err
	}
	off := int64(i) * d.stride
	for len(buf) > 0 {
		n, err := unix.Pwrite(d.fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("disk tier %s: write block %d: %w", d.path, i, err)
		}
		if n == 0 {
			return fmt.Errorf("disk tier %s: write block %d: %w", d.path, i, io.ErrShortWrite)
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
	off := int64(i) * d.stride
	for len(buf) > 0 {
		n, err := unix.Pread(d.fd, buf, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("disk tier %s: read block %d: %w", d.path, i, err)
		}
		if n == 0 {
			return fmt.Errorf("disk tier %s: read block %d: %w", d.path, i, io.ErrUnexpectedEOF)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// Close closes and removes the file. A crashed process leaves its file
// behind; the pid in the name tells an operator whose it was.
func (d *DiskRegion) Close() error {
	var errs []error
	if d.fd >= 0 {
		if err := unix.Close(d.fd); err != nil {
			errs = append(errs, fmt.Errorf("disk tier %s: close: %w", d.path, err))
		}
		d.fd = -1
	}
	if d.path != "" {
		if err := os.Remove(d.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("disk tier %s: remove: %w", d.path, err))
		}
		d.path = ""
	}
	return errors.Join(errs...)
}

// diskFilePrefix starts every disk tier file name: kvbm-disk-cache-<pid>-rank<r>-<random>.
const diskFilePrefix = "kvbm-disk-cache-"

// removeStaleFiles deletes disk tier files left in dir by processes that no
// longer exist (a crash skips Close, which removes the file). Their contents
// are useless: the registry that indexed them died with the process. Files of
// live processes (another engine on this host) are left alone.
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
		rest := name[len(diskFilePrefix):]
		i := strings.IndexByte(rest, '-')
		if i <= 0 {
			continue
		}
		pid, err := strconv.Atoi(rest[:i])
		if err != nil || pid <= 0 || pid == os.Getpid() || processAlive(pid) {
			continue
		}
		path := filepath.Join(dir, name)
		if err := os.Remove(path); err == nil {
			log.Info("kvbm disk tier: removed a file left by a process that no longer runs", "path", path, "pid", pid)
		}
	}
}

// processAlive reports whether pid names a running process (EPERM: it exists
// but belongs to someone else).
func processAlive(pid int) bool {
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}
