package workerbench

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// FS describes the filesystem holding a bench directory.
type FS struct {
	Dir    string // the directory, symlinks resolved
	Type   string // from /proc/self/mountinfo ("ext4", "xfs", "tmpfs"); the statfs magic in hex if not found
	Source string // the mounted device or source ("/dev/nvme0n1p1"); "" if unknown
	Mount  string // the mount point; "" if unknown
	Memory bool   // statfs says tmpfs or ramfs: "disk" I/O there is memory I/O, O_DIRECT does not apply
}

func (fs FS) String() string {
	if fs.Source == "" {
		return fmt.Sprintf("%s (%s)", fs.Type, fs.Dir)
	}
	return fmt.Sprintf("%s on %s mounted at %s (%s)", fs.Type, fs.Source, fs.Mount, fs.Dir)
}

// StatFS identifies dir's filesystem: statfs for the memory-backed check,
// the longest matching mount point of /proc/self/mountinfo for the name.
func StatFS(dir string) (FS, error) {
	abs, err := filepath.Abs(dir)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return FS{}, fmt.Errorf("workerbench: bench dir %q: %w", dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(abs, &st); err != nil {
		return FS{}, fmt.Errorf("workerbench: statfs %s: %w", abs, err)
	}
	fs := FS{Dir: abs, Type: fmt.Sprintf("magic %#x", st.Type),
		Memory: st.Type == unix.TMPFS_MAGIC || st.Type == unix.RAMFS_MAGIC}
	mi, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return fs, nil
	}
	defer func() { _ = mi.Close() }()
	sc := bufio.NewScanner(mi)
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source superoptions
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		a, b := strings.Fields(pre), strings.Fields(post)
		if !ok || len(a) < 5 || len(b) < 2 {
			continue
		}
		mp := unescapeMount(a[4])
		if !within(abs, mp) || len(mp) < len(fs.Mount) {
			continue
		}
		fs.Mount, fs.Type, fs.Source = mp, b[0], unescapeMount(b[1])
	}
	return fs, nil
}

func within(path, mount string) bool {
	return mount == "/" || path == mount || strings.HasPrefix(path, mount+"/")
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c byte
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(c)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// DefaultDir is the first of os.TempDir(), /var/tmp and the working
// directory that exists and is not memory-backed (on many systems /tmp is a
// tmpfs, where O_DIRECT cannot work and the G3 figures would be memory
// copies); os.TempDir() if none is.
func DefaultDir() string {
	cands := []string{os.TempDir(), "/var/tmp"}
	if wd, err := os.Getwd(); err == nil {
		cands = append(cands, wd)
	}
	for _, d := range cands {
		if fs, err := StatFS(d); err == nil && !fs.Memory && unix.Access(fs.Dir, unix.W_OK) == nil {
			return d
		}
	}
	return os.TempDir()
}
