package leader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

// Tombstones of a persistent G3 tier (design §12): the blocks a purge
// removed, by index and sequence hash, appended (and synced) to a file next
// to the tier files before the purge returns. Workers make a dropped block
// unrecoverable only when the next engine step reaches them; a restart
// before that would bring purged blocks back, so RestoreDisk skips every
// recovered block whose index and hash match a tombstone, and drops it in
// the first step. A tombstone whose index was written again since no longer
// matches (the header there names another hash) and is harmless; the file
// is compacted at each restore to the tombstones that still matched.
//
// The file holds no request contents (indexes and hashes) and can only make
// kvbm forget blocks, so at worst a forged one costs recomputation.

// TombstoneFile is the tombstone file's name in DYN_KVBM_DISK_CACHE_DIR.
const TombstoneFile = "kvbm-g3-purged.tomb"

const tombstoneBytes = 16 // block i64, hash u64, little-endian

type tombstone struct {
	block int64
	hash  uint64
}

// tombstones is the file; a nil *tombstones (no persistent tier) does
// nothing.
type tombstones struct {
	path string
	mu   sync.Mutex // serialises file writes
}

func newTombstones(dir string) *tombstones {
	return &tombstones{path: filepath.Join(dir, TombstoneFile)}
}

// add appends ts and syncs the file.
func (t *tombstones) add(ts []tombstone) error {
	if t == nil || len(ts) == 0 {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	f, err := os.OpenFile(t.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("leader: purge: record purged disk blocks: %w", err)
	}
	buf := make([]byte, 0, len(ts)*tombstoneBytes)
	for _, x := range ts {
		buf = binary.LittleEndian.AppendUint64(buf, uint64(x.block))
		buf = binary.LittleEndian.AppendUint64(buf, x.hash)
	}
	_, err = f.Write(buf)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("leader: purge: record purged disk blocks in %s: %w", t.path, err)
	}
	return nil
}

// load reads the tombstones (none when the file is missing; a torn last
// record is ignored).
func (t *tombstones) load() (map[tombstone]struct{}, error) {
	if t == nil {
		return nil, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	f, err := os.OpenFile(t.path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("leader: read purged disk blocks: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("leader: read purged disk blocks from %s: %w", t.path, err)
	}
	m := make(map[tombstone]struct{}, len(b)/tombstoneBytes)
	for ; len(b) >= tombstoneBytes; b = b[tombstoneBytes:] {
		m[tombstone{int64(binary.LittleEndian.Uint64(b)), binary.LittleEndian.Uint64(b[8:])}] = struct{}{}
	}
	return m, nil
}

// rewrite replaces the file with keep (removes it when keep is empty).
func (t *tombstones) rewrite(keep []tombstone) error {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	tmp := t.path + ".tmp"
	_ = os.Remove(tmp)
	t.mu.Unlock()
	if len(keep) == 0 {
		if err := os.Remove(t.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("leader: compact purged disk blocks: %w", err)
		}
		return nil
	}
	t2 := &tombstones{path: tmp}
	if err := t2.add(keep); err != nil {
		return err
	}
	if err := os.Rename(tmp, t.path); err != nil {
		return fmt.Errorf("leader: compact purged disk blocks: %w", err)
	}
	return nil
}
