// Package storage owns kvbm's own memory: the host tier (G2) as one region
// mapped outside the Go heap, and the disk tier (G3) as one preallocated file
// read and written in whole, aligned blocks — optionally kept across
// restarts with a header per block (persist.go).
package storage

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/layout"
)

// Alignment is the block alignment of host and disk regions: O_DIRECT needs
// offsets, sizes and buffer addresses aligned to the logical block size, and
// 4096 covers every common device. Aligning host blocks too lets a G2 block
// be the buffer of a G3 I/O with no bounce copy.
const Alignment = 4096

// HostRegion is numBlocks equally sized blocks in one anonymous mapping. It is
// allocated once, never grows, and lives outside the Go heap so a large host
// tier neither doubles the process's RSS at GC time nor gets scanned.
type HostRegion struct {
	node       int // NUMA node its pages prefer; -1: the default policy
	mem        []byte
	numBlocks  int
	blockBytes int64
	stride     int64
}

// NewHostRegion maps numBlocks blocks of blockBytes payload each; every block
// starts on an Alignment boundary. populate pre-faults the pages (slower start,
// no page faults on the first transfers).
func NewHostRegion(numBlocks int, blockBytes int64, populate bool) (*HostRegion, error) {
	return NewHostRegionOnNode(numBlocks, blockBytes, populate, -1)
}

// NewHostRegionOnNode is NewHostRegion with the pages placed on NUMA node
// node (≥ 0; bindToNode: preferred, before they are faulted in). A kernel
// or sandbox that refuses the policy (seccomp without CAP_SYS_NICE) is an
// error wrapping ErrNUMAPolicy; the region is then not created.
func NewHostRegionOnNode(numBlocks int, blockBytes int64, populate bool, node int) (*HostRegion, error) {
	if numBlocks <= 0 || blockBytes <= 0 {
		return nil, fmt.Errorf("storage: host region: %d blocks of %d bytes: both must be > 0", numBlocks, blockBytes)
	}
	stride := layout.AlignUp(blockBytes, Alignment)
	size := stride * int64(numBlocks)
	if size/int64(numBlocks) != stride {
		return nil, fmt.Errorf("storage: host region: %d blocks × %d bytes overflows", numBlocks, stride)
	}
	// Refuse what the machine cannot hold: with overcommit the mmap would
	// succeed and the populate (or a later transfer) would summon the OOM
	// killer on the engine process instead of giving a startup error.
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err == nil {
		total := int64(si.Totalram) * int64(si.Unit)
		if total > 0 && size > total {
			return nil, fmt.Errorf("storage: host region: %d blocks × %d bytes = %d bytes is more than this machine's %d bytes of RAM "+
				"(lower DYN_KVBM_CPU_CACHE_GB or DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS)", numBlocks, stride, size, total)
		}
	}
	mem, err := mapAnon(size, populate && node < 0)
	if err != nil {
		return nil, fmt.Errorf("storage: host region: map %d blocks × %d bytes: %w", numBlocks, stride, err)
	}
	if node >= 0 {
		if err := bindToNode(mem, node); err != nil {
			_ = unix.Munmap(mem)
			return nil, fmt.Errorf("storage: host region: %w: %w", ErrNUMAPolicy, err)
		}
		if populate {
			populatePages(mem)
		}
	}
	return &HostRegion{node: node, mem: mem, numBlocks: numBlocks, blockBytes: blockBytes, stride: stride}, nil
}

func mapAnon(size int64, populate bool) ([]byte, error) {
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	// Huge pages cut TLB misses on multi-GB copies; a kernel without THP
	// just says no, which costs nothing. Ask before populating, or the
	// region is faulted in as small pages (what MAP_POPULATE would do).
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	if populate {
		populatePages(mem)
	}
	return mem, nil
}

// populatePages faults mem's pages in.
func populatePages(mem []byte) {
	if err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE); err != nil {
		// Kernels before 5.14: touch one byte per page instead.
		for i := 0; i < len(mem); i += 4096 {
			mem[i] = 0
		}
	}
}

// NUMANode is the NUMA node the region's pages prefer, or -1.
func (r *HostRegion) NUMANode() int { return r.node }

// ErrNUMAPolicy: the kernel refused to set a region's NUMA memory policy.
var ErrNUMAPolicy = errors.New("cannot set the NUMA memory policy (DYN_KVBM_ENABLE_NUMA)") // errprefix: only wrapped, by NewHostRegionOnNode

// NumBlocks is the number of blocks in the region.
func (r *HostRegion) NumBlocks() int { return r.numBlocks }

// BlockBytes is the payload size of one block.
func (r *HostRegion) BlockBytes() int64 { return r.blockBytes }

// Stride is the distance between blocks (BlockBytes rounded up to Alignment).
func (r *HostRegion) Stride() int64 { return r.stride }

// Block returns block i's payload (BlockBytes long). i must be in range.
func (r *HostRegion) Block(i int) []byte {
	off := int64(i) * r.stride
	return r.mem[off : off+r.blockBytes : off+r.blockBytes]
}

// IOBlock returns block i including its alignment padding (Stride long,
// Alignment-aligned): the buffer shape O_DIRECT I/O needs.
func (r *HostRegion) IOBlock(i int) []byte {
	off := int64(i) * r.stride
	return r.mem[off : off+r.stride : off+r.stride]
}

// Close unmaps the region. No slice obtained from it may be used afterwards.
func (r *HostRegion) Close() error {
	if r.mem == nil {
		return nil
	}
	err := unix.Munmap(r.mem)
	r.mem = nil
	if err != nil {
		return fmt.Errorf("storage: host region: unmap: %w", err)
	}
	return nil
}
