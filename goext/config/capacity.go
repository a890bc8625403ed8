package config

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvbm/kvbm/goext/internal/checked"
)

// MaxBlocks is the most blocks a tier may hold: pools index blocks with
// int32.
const MaxBlocks = math.MaxInt32

// The machine's capacity, read when a size is checked. Tests replace them.
var (
	availableMemory = memAvailable
	availableDisk   = diskAvailable
	openFilesLimit  = nofileLimit
)

// nofileLimit is this process's soft limit on open files (RLIMIT_NOFILE);
// ok is false where it cannot be read or is unlimited.
func nofileLimit() (limit uint64, ok bool) {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil || r.Cur == math.MaxUint64 {
		return 0, false
	}
	return r.Cur, true
}

// memAvailable is the kernel's estimate of memory available for new
// allocations without swapping (MemAvailable in /proc/meminfo), in bytes;
// ok is false where it cannot be read.
func memAvailable() (bytes uint64, ok bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, found := strings.CutPrefix(sc.Text(), "MemAvailable:")
		if !found {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		if err != nil || kb > math.MaxUint64/1024 {
			return 0, false
		}
		return kb * 1024, true
	}
	return 0, false
}

// diskAvailable is the space an unprivileged process can still use in dir's
// filesystem, in bytes; ok is false where it cannot be read.
func diskAvailable(dir string) (bytes uint64, ok bool) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil || st.Bsize <= 0 {
		return 0, false
	}
	if st.Bavail > math.MaxUint64/uint64(st.Bsize) {
		return math.MaxUint64, true
	}
	return st.Bavail * uint64(st.Bsize), true
}

// checkCapacity reports why bytes does not fit in what (memory or disk),
// or "" when it fits or the capacity is unknown.
func checkCapacity(bytes uint64, what string, avail func() (uint64, bool)) string {
	free, ok := avail()
	if !ok || bytes <= free {
		return ""
	}
	return fmt.Sprintf("needs %d bytes, more than the %d bytes of %s available", bytes, free, what)
}

// CheckBlocks checks the tier sizes for one block of bytesPerBlockAllWorkers
// (summed over all workers, as for HostBlocks) before anything is allocated:
// each tier holds at most MaxBlocks blocks and fits in the memory (host tier)
// or the disk space of DiskCacheDir (disk tier, whose blocks' bookkeeping
// must also fit in memory) available now. The error
// joins one *VarError per tier, naming the variable that sized it.
func (c *Config) CheckBlocks(bytesPerBlockAllWorkers int64) error {
	if bytesPerBlockAllWorkers <= 0 {
		return nil
	}
	var errs []error
	check := func(enabled bool, override int, gb float64, gbVar, overrideVar, what string, avail func() (uint64, bool)) {
		if !enabled {
			return
		}
		name, value := gbVar, strconv.FormatFloat(gb, 'g', -1, 64)
		if override > 0 {
			name, value = overrideVar, strconv.Itoa(override)
		}
		n := blocks(override, gb, bytesPerBlockAllWorkers)
		if n > MaxBlocks {
			errs = append(errs, &VarError{Name: name, Value: value, Reason: fmt.Sprintf(
				"gives %d blocks of %d bytes; a tier holds at most %d blocks", n, bytesPerBlockAllWorkers, MaxBlocks)})
			return
		}
		bytes, ok := checked.Mul(n, bytesPerBlockAllWorkers)
		if !ok {
			errs = append(errs, &VarError{Name: name, Value: value, Reason: fmt.Sprintf(
				"%d blocks × %d bytes per block overflows a 64-bit size", n, bytesPerBlockAllWorkers)})
			return
		}
		if reason := checkCapacity(uint64(bytes), what, avail); reason != "" {
			errs = append(errs, &VarError{Name: name, Value: value, Reason: fmt.Sprintf(
				"%d blocks of %d bytes %s", n, bytesPerBlockAllWorkers, reason)})
		}
	}
	check(c.HostEnabled(), c.CPUCacheOverrideBlocks, c.CPUCacheGB, EnvCPUCacheGB, EnvCPUCacheOverrideBlocks,
		"memory", availableMemory)
	before := len(errs)
	check(c.DiskEnabled(), c.DiskCacheOverrideBlocks, c.DiskCacheGB, EnvDiskCacheGB, EnvDiskCacheOverrideBlocks,
		"disk space in "+c.DiskCacheDir, func() (uint64, bool) { return availableDisk(c.DiskCacheDir) })
	if len(errs) == before { // one error per tier
		if err := c.checkDiskBookkeeping(bytesPerBlockAllWorkers); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// BlockBookkeepingBytes bounds the memory each block of a tier costs
// besides its payload: the leader's pool entry (about 80 bytes) and the
// workers' per-block state (up to 17 bytes a rank), rounded up.
const BlockBookkeepingBytes = 128

// checkDiskBookkeeping: a disk tier's payload is on disk, but every block
// has bookkeeping in memory, so a tier of many small blocks whose file fits
// on disk could still need more memory than the machine has.
func (c *Config) checkDiskBookkeeping(bytesPerBlockAllWorkers int64) error {
	if !c.DiskEnabled() {
		return nil
	}
	n := blocks(c.DiskCacheOverrideBlocks, c.DiskCacheGB, bytesPerBlockAllWorkers)
	if n > MaxBlocks {
		return nil // CheckBlocks' own error
	}
	// n ≤ MaxBlocks < 2^31: the product fits.
	reason := checkCapacity(uint64(n)*BlockBookkeepingBytes, "memory", availableMemory)
	if reason == "" {
		return nil
	}
	name, value := EnvDiskCacheGB, strconv.FormatFloat(c.DiskCacheGB, 'g', -1, 64)
	if c.DiskCacheOverrideBlocks > 0 {
		name, value = EnvDiskCacheOverrideBlocks, strconv.Itoa(c.DiskCacheOverrideBlocks)
	}
	return &VarError{Name: name, Value: value, Reason: fmt.Sprintf(
		"%d blocks of %d bytes: their bookkeeping (%d bytes a block) %s", n, bytesPerBlockAllWorkers,
		BlockBookkeepingBytes, reason)}
}

// TierBlocks sizes the host (G2) and disk (G3) tiers, in blocks, for
// numWorkers ranks of bytesPerBlock bytes each (design §2): CheckBlocks, then
// HostBlocks / DiskBlocks of the total. A configured tier that holds no
// block is an error naming its variable, and so is no tier at all
// (ErrNoTier). The leader, the side channel's handshake and every worker
// size the tiers with this one function, so they agree.
func (c *Config) TierBlocks(bytesPerBlock int64, numWorkers int) (host, disk int, err error) {
	if bytesPerBlock < 1 || numWorkers < 1 {
		return 0, 0, fmt.Errorf("config: tier sizing: %d workers × %d bytes per block: both must be positive", numWorkers, bytesPerBlock)
	}
	total := bytesPerBlock * int64(numWorkers)
	if total/int64(numWorkers) != bytesPerBlock {
		return 0, 0, fmt.Errorf("config: tier sizing: %d workers × %d bytes per block overflows", numWorkers, bytesPerBlock)
	}
	if err := c.CheckBlocks(total); err != nil {
		return 0, 0, err
	}
	none := func(gbVar, overrideVar string, gb float64) error {
		return &VarError{Name: gbVar, Value: strconv.FormatFloat(gb, 'g', -1, 64), Reason: fmt.Sprintf(
			"holds no block of %d bytes (%d workers × %d bytes per block); raise it or set %s",
			total, numWorkers, bytesPerBlock, overrideVar)}
	}
	if c.HostEnabled() {
		if host = c.HostBlocks(total); host < 1 {
			return 0, 0, none(EnvCPUCacheGB, EnvCPUCacheOverrideBlocks, c.CPUCacheGB)
		}
	}
	if c.DiskEnabled() {
		if disk = c.DiskBlocks(total); disk < 1 {
			return 0, 0, none(EnvDiskCacheGB, EnvDiskCacheOverrideBlocks, c.DiskCacheGB)
		}
	}
	if host == 0 && disk == 0 {
		return 0, 0, ErrNoTier
	}
	return host, disk, nil
}
