package workerbench

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The G3 baselines do what kvbm's disk path does minus its own work
// (checksums, scatter, bookkeeping): DiskDepth goroutines, each taking the
// next batch of BatchSize blocks and issuing one O_DIRECT pread or pwrite
// of one stride per block, into one aligned buffer per goroutine. Reads
// read kvbm's own tier file (the same bytes at the same offsets); writes go
// to a separate preallocated file of the same size, since writing the tier
// file would break kvbm's checksums. Neither side fsyncs: kvbm's G3 write
// does not, and an O_DIRECT write has left the page cache when it returns.

// ErrNoDirect: the O_DIRECT baselines cannot run because the filesystem of
// the bench directory does not do O_DIRECT (the wrapped error says how it failed).
var ErrNoDirect = errors.New("workerbench: O_DIRECT not available")

// DiskDepth is the number of G3 batches kvbm keeps in flight for a given
// MaxConcurrent. It mirrors worker.diskSlots (diskDepth = 2); keep the two
// in step.
func DiskDepth(maxConcurrent int) int {
	if maxConcurrent <= 1 {
		return 1
	}
	return 2 * maxConcurrent
}

// openDiskBaselines creates the write baseline's file and opens kvbm's tier
// file for the read baselines. An O_DIRECT failure is recorded in
// f.directErr, not returned: the memory rows still run.
func (f *Fixture) openDiskBaselines() error {
	stride := f.stride()
	size := stride * int64(f.Opts.Blocks)
	var err error
	// The same kind of memory as kvbm's G2 and bounce buffers
	// (storage.NewHostRegion): huge pages where the kernel gives them. With
	// 4 KiB pages an O_DIRECT I/O pins and maps 512 pages per 2 MiB instead
	// of one, which measured at half the throughput on a VM's disk.
	if f.lanes, err = unix.Mmap(-1, 0, int(stride)*f.DiskDepth, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return fmt.Errorf("workerbench: map I/O buffers: %w", err)
	}
	_ = unix.Madvise(f.lanes, unix.MADV_HUGEPAGE)
	for i := range f.lanes { // not zeros: some devices compress or skip them
		f.lanes[i] = byte(i*7 + i>>12)
	}
	tier := f.Worker.DiskPath()
	if f.bufFD, err = unix.Open(tier, unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("workerbench: open tier file %s: %w", tier, err)
	}
	direct := filepath.Join(f.dir, "direct")
	if f.writeFD, err = unix.Open(direct, unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT|unix.O_CLOEXEC, 0o600); err != nil {
		f.directErr = fmt.Errorf("%w: open %s: %v", ErrNoDirect, direct, err)
		return nil
	}
	if err := unix.Fallocate(f.writeFD, 0, 0, size); err != nil {
		if err := unix.Ftruncate(f.writeFD, size); err != nil {
			return fmt.Errorf("workerbench: size %s: %w", direct, err)
		}
	}
	if err := fullIO(f.writeFD, f.lane(0), 0, true); err != nil {
		f.directErr = fmt.Errorf("%w: write %s: %v", ErrNoDirect, direct, err)
		return nil
	}
	if f.readFD, err = unix.Open(tier, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0); err != nil {
		f.directErr = fmt.Errorf("%w: open %s: %v", ErrNoDirect, tier, err)
		return nil
	}
	if err := fullIO(f.readFD, f.lane(0), 0, false); err != nil {
		f.directErr = fmt.Errorf("%w: read %s: %v", ErrNoDirect, tier, err)
	}
	return nil
}

func (f *Fixture) closeDiskBaselines() {
	for _, fd := range []int{f.writeFD, f.readFD, f.bufFD} {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
	}
}

// stride is the tier file's distance between blocks (storage.DiskRegion.Stride).
func (f *Fixture) stride() int64 { return (f.Engine.BytesPerBlock() + 4095) &^ 4095 }

func (f *Fixture) lane(i int) []byte {
	s := f.stride()
	return f.lanes[int64(i)*s : int64(i+1)*s]
}

// DirectErr is nil when the O_DIRECT baselines run, else why they cannot (ErrNoDirect).
func (f *Fixture) DirectErr() error { return f.directErr }

// fullIO issues one pread or pwrite of buf at off, continuing short transfers.
func fullIO(fd int, buf []byte, off int64, write bool) error {
	for len(buf) > 0 {
		var n int
		var err error
		if write {
			n, err = unix.Pwrite(fd, buf, off)
		} else {
			n, err = unix.Pread(fd, buf, off)
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("workerbench: %d bytes left at offset %d: unexpected end", len(buf), off)
		}
		buf, off = buf[n:], off+int64(n)
	}
	return nil
}

// directIO runs the baseline: DiskDepth goroutines over batches of BatchSize blocks.
func (f *Fixture) directIO(fd int, write bool) (time.Duration, error) {
	if f.directErr != nil {
		return 0, f.directErr
	}
	stride, blocks, batch := f.stride(), f.Opts.Blocks, f.Opts.BatchSize
	var next atomic.Int64
	errs := make([]error, f.DiskDepth)
	var wg sync.WaitGroup
	start := time.Now()
	for lane := range f.DiskDepth {
		wg.Go(func() {
			buf := f.lane(lane)
			for {
				lo := int(next.Add(1)-1) * batch
				if lo >= blocks {
					return
				}
				for i := lo; i < min(lo+batch, blocks); i++ {
					if err := fullIO(fd, buf, int64(i)*stride, write); err != nil {
						errs[lane] = err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start), errors.Join(errs...)
}

// DirectWrite is the G3 write baseline: kvbm's queue depth and I/O size,
// O_DIRECT, no fsync, into a file of the tier's size.
func (f *Fixture) DirectWrite() (time.Duration, error) { return f.directIO(f.writeFD, true) }

// DirectRead is the G3 read baseline: kvbm's queue depth and I/O size,
// O_DIRECT, over the blocks of kvbm's tier file. Run DiskWrite first.
func (f *Fixture) DirectRead() (time.Duration, error) { return f.directIO(f.readFD, false) }

// BufferedRead reads the same region of the tier file with one buffered
// sequential reader (one stride per read), from a cold page cache: it drops
// the file's cached pages before and after.
func (f *Fixture) BufferedRead() (time.Duration, error) {
	if err := f.DropTierCache(); err != nil {
		return 0, err
	}
	stride, buf := f.stride(), f.lane(0)
	start := time.Now()
	for i := range f.Opts.Blocks {
		if err := fullIO(f.bufFD, buf, int64(i)*stride, false); err != nil {
			return 0, fmt.Errorf("workerbench: buffered read of the tier file: %w", err)
		}
	}
	d := time.Since(start)
	return d, f.DropTierCache()
}

// DropTierCache drops the tier file's clean cached pages (none when kvbm
// uses O_DIRECT; its whole working set when it fell back to buffered I/O).
func (f *Fixture) DropTierCache() error {
	if err := unix.Fadvise(f.bufFD, 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("workerbench: fadvise DONTNEED on the tier file: %w", err)
	}
	return nil
}

// TierResident is how many bytes of the tier file's working set are in the
// page cache (mincore). Before a cold read it must be 0.
func (f *Fixture) TierResident() (int64, error) {
	size := int(f.stride()) * f.Opts.Blocks
	m, err := unix.Mmap(f.bufFD, 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("workerbench: map tier file for mincore: %w", err)
	}
	defer func() { _ = unix.Munmap(m) }()
	page := os.Getpagesize()
	vec := make([]byte, (size+page-1)/page)
	// x/sys/unix has no Mincore wrapper on linux.
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(size),
		uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		return 0, fmt.Errorf("workerbench: mincore on the tier file: %w", e)
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return n * int64(page), nil
}
