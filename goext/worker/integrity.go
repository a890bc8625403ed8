package worker

// Disk reads and writes with their checksums, and the switch to a degraded
// (G2-only) tier after a disk I/O error.

import (
	"fmt"

	"github.com/zeebo/xxh3"
)

// writeDisk writes buf (an aligned IO block whose payload is the first bpb
// bytes) to G3 block dst and records its checksum.
//
// errprefix: its errors are the copy's, which Run's error wraps.
func (w *Worker) writeDisk(dst int, buf []byte) error {
	w.diskValid[dst].Store(false)
	if w.degraded.Load() {
		return fmt.Errorf("G3 block %d: %w", dst, ErrDiskDegraded)
	}
	sum := xxh3.Hash(buf[:w.bpb])
	if err := w.writeDiskBlock(dst, buf, sum); err != nil {
		w.degrade(err)
		return err
	}
	w.diskSum[dst].Store(sum)
	w.diskValid[dst].Store(true)
	return nil
}

// readDisk reads G3 block src into buf and verifies it. A block that does not
// verify is forgotten, so it is never served again.
//
// errprefix: its errors are the copy's, which Run's error wraps.
func (w *Worker) readDisk(src int, buf []byte) error {
	if w.degraded.Load() {
		return fmt.Errorf("G3 block %d: %w", src, ErrDiskDegraded)
	}
	if !w.diskValid[src].Load() {
		return fmt.Errorf("G3 block %d: %w", src, ErrNotValid)
	}
	if err := w.disk.ReadBlock(src, buf); err != nil {
		w.degrade(err)
		return err
	}
	if v, ok := w.disk.(recoveredDisk); ok {
		// A block recovered from a persistent tier and not rewritten
		// since: its payload must match the MAC of its header (the XXH3
		// below can be matched by whoever wrote the payload).
		if err := v.VerifyRecovered(src, buf[:w.bpb]); err != nil {
			w.diskValid[src].Store(false)
			w.forgetOnDisk(src)
			w.m.G3LoadUnauthenticated().Inc()
			w.log.Warn("kvbm disk tier: a recovered block does not verify against its MAC; not served", "block", src,
				"err", err)
			return fmt.Errorf("G3 block %d: %w", src, err)
		}
	}
	if got, want := xxh3.Hash(buf[:w.bpb]), w.diskSum[src].Load(); got != want {
		w.diskValid[src].Store(false)
		w.forgetOnDisk(src)
		return fmt.Errorf("G3 block %d: %w (stored %016x, read %016x)", src, ErrChecksum, want, got)
	}
	return nil
}

// degrade switches the disk tier off after its first I/O error and says so once.
func (w *Worker) degrade(err error) {
	if w.degraded.CompareAndSwap(false, true) {
		w.log.Error("kvbm disk tier failed; continuing without it (G3 loads fail and are recomputed, G2→G3 offload stops)",
			"path", w.DiskPath(), "err", err)
	}
}
