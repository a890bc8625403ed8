package workerbench

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/transfer"
)

// TestEveryRowRuns runs each operation and baseline of bench/transfer once
// on a small fixture: the table's plumbing, not its numbers.
func TestEveryRowRuns(t *testing.T) {
	f, err := New(Options{Blocks: 8, Disk: true, DiskDir: t.TempDir(), BatchSize: 2})
	require.NoError(t, err)
	defer f.Close()
	require.Equal(t, DiskDepth(f.Opts.MaxConcurrent), f.DiskDepth)
	type row struct {
		name string
		op   func() error
	}
	ops := []row{
		{"offload", func() error { _, err := f.Offload(); return err }},
		{"onboard", func() error { _, err := f.Onboard(); return err }},
		{"disk write", func() error { _, err := f.DiskWrite(); return err }},
		{"disk read", func() error { _, err := f.DiskRead(); return err }},
		{"buffered read", func() error { _, err := f.BufferedRead(); return err }},
	}
	if f.DirectErr() == nil {
		ops = append(ops,
			row{"direct write", func() error { _, err := f.DirectWrite(); return err }},
			row{"direct read", func() error { _, err := f.DirectRead(); return err }})
	} else {
		require.ErrorIs(t, f.DirectErr(), ErrNoDirect)
	}
	for _, o := range ops {
		require.NoError(t, o.op(), o.name)
	}
	for _, nt := range []bool{false, true} {
		require.Positive(t, f.ParallelCopy(3, nt))
	}
	require.Positive(t, f.CopyCeiling(1).GBps)
	if f.Worker.DiskDirect() && !f.FS.Memory {
		require.NoError(t, f.DropTierCache())
		n, err := f.TierResident()
		require.NoError(t, err)
		require.Zero(t, n, "an O_DIRECT tier file left pages in the page cache")
	}
}

func TestNTCopyCopiesEveryByte(t *testing.T) {
	src := make([]byte, 1000)
	for i := range src {
		src[i] = byte(i*31 + 7)
	}
	for _, r := range []struct{ off, n int }{{0, 0}, {0, 1000}, {1, 999}, {3, 130}, {15, 256}} {
		dst := make([]byte, 1024)
		transfer.CopyNonTemporal(dst[r.off:r.off+r.n], src[:r.n])
		require.Equal(t, src[:r.n], dst[r.off:r.off+r.n], "offset %d, %d bytes", r.off, r.n)
	}
}

func TestStatFSNamesTheFilesystem(t *testing.T) {
	fs, err := StatFS(t.TempDir())
	require.NoError(t, err)
	require.NotEmpty(t, fs.Type)
	if _, err := os.Stat("/dev/shm"); err == nil {
		shm, err := StatFS("/dev/shm")
		require.NoError(t, err)
		require.True(t, shm.Memory, "/dev/shm is %s", shm)
	}
	d, err := StatFS(DefaultDir())
	require.NoError(t, err)
	if !fs.Memory {
		require.False(t, d.Memory, "DefaultDir chose %s although %s is a disk", d, fs)
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{`/`: `/`, `/mnt/a\040b`: `/mnt/a b`, `/x\134y`: `/x\y`, `/odd\04`: `/odd\04`} {
		require.Equal(t, want, unescapeMount(in), in)
	}
}
