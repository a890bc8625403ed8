package storage

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Memory policy modes and flags of mbind(2) and get_mempolicy(2)
// (linux/mempolicy.h); golang.org/x/sys/unix does not define them.
const (
	mpolDefault   = 0
	mpolPreferred = 1
	mpolFAddr     = 1 << 1 // get_mempolicy: the policy of the page at addr
)

// maxNUMANodes bounds the node numbers mbind is given (one 64-bit mask).
const maxNUMANodes = 64

// CurrentNUMANode returns the NUMA node of the CPU the calling thread runs
// on (getcpu(2)) and the number of NUMA nodes online.
func CurrentNUMANode() (node, nodes int, err error) {
	var cpu, nd uint32
	if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), uintptr(unsafe.Pointer(&nd)), 0); errno != 0 {
		return 0, 0, fmt.Errorf("storage: getcpu: %w", errno)
	}
	nodes, err = onlineNUMANodes("/sys/devices/system/node/online")
	if err != nil {
		return int(nd), 0, err
	}
	return int(nd), nodes, nil
}

// onlineNUMANodes counts the nodes in a kernel CPU/node list ("0", "0-3",
// "0,2-3"). A kernel without NUMA has no such file: one node.
func onlineNUMANodes(path string) (int, error) {
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return 1, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, isRange := strings.Cut(r, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return 0, fmt.Errorf("storage: %s: %q: %w", path, b, err)
		}
		z := a
		if isRange {
			if z, err = strconv.Atoi(hi); err != nil || z < a {
				return 0, fmt.Errorf("storage: %s: %q: bad range %q", path, b, r)
			}
		}
		n += z - a + 1
	}
	return n, nil
}

// bindToNode sets the memory policy of mem's pages to prefer NUMA node
// node. Preferred rather than strict: a region larger than the node's free
// memory takes the rest from other nodes instead of failing to populate
// (or waking the OOM killer on the engine). Pages already faulted in are
// not moved, so it is called before the region is populated.
//
// errprefix: its errors are wrapped by NewHostRegionOnNode.
func bindToNode(mem []byte, node int) error {
	if node < 0 || node >= maxNUMANodes {
		return fmt.Errorf("NUMA node %d out of range 0..%d", node, maxNUMANodes-1)
	}
	mask := uint64(1) << node
	// maxnode counts bits and the kernel reads one fewer (mbind(2) BUGS).
	_, _, errno := unix.Syscall6(unix.SYS_MBIND, uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)),
		mpolPreferred, uintptr(unsafe.Pointer(&mask)), maxNUMANodes+1, 0)
	if errno != 0 {
		return fmt.Errorf("mbind: %w", errno)
	}
	return nil
}

// memPolicy returns the memory policy mode and node mask of the page at
// addr (get_mempolicy(2) with MPOL_F_ADDR).
func memPolicy(addr unsafe.Pointer) (mode int, mask uint64, err error) {
	var m int32
	_, _, errno := unix.Syscall6(unix.SYS_GET_MEMPOLICY, uintptr(unsafe.Pointer(&m)), uintptr(unsafe.Pointer(&mask)),
		maxNUMANodes+1, uintptr(addr), mpolFAddr, 0)
	if errno != 0 {
		return 0, 0, fmt.Errorf("storage: get_mempolicy: %w", errno)
	}
	return int(m), mask, nil
}
