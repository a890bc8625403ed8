package transfer

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvbm/kvbm/goext/layout"
)

func mmap(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

// TestGatherOrder checks the host layout byte for byte against a hand-made
// expectation: [layer][K,V][chunk], each chunk the engine's bytes verbatim.
func TestGatherOrder(t *testing.T) {
	const n, bs, h, d, layers = 6, 2, 3, 4, 2 // FlashAttention [2, N, bs, H, D], 1-byte dtype
	chunk := bs * h * d
	mems := make([][]byte, layers)
	var tensors []layout.Tensor
	for l := range mems {
		mems[l] = mmap(t, 2*n*chunk)
		for i := range mems[l] {
			mems[l][i] = byte(i*7 + l*31)
		}
		tensors = append(tensors, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&mems[l][0])), Shape: []int64{2, n, bs, h, d}})
	}
	e, err := layout.NewEngine(layout.Spec{Tensors: tensors, NumBlocks: n, BlockSize: bs, DtypeBytes: 1})
	require.NoError(t, err)
	require.Equal(t, layout.FlashAttn, e.Kind)

	const block = 4
	var want []byte
	for l := 0; l < layers; l++ {
		for kv := 0; kv < 2; kv++ {
			off := (kv*n + block) * chunk
			want = append(want, mems[l][off:off+chunk]...)
		}
	}
	got := make([]byte, e.BytesPerBlock())
	Gather(e, block, got)
	require.Equal(t, want, got)

	// Scatter into another block puts the same bytes where that block lives
	// and leaves every other block alone.
	before := [][]byte{bytes.Clone(mems[0]), bytes.Clone(mems[1])}
	Scatter(e, 1, got)
	for l := 0; l < layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for b := 0; b < n; b++ {
				off := (kv*n + b) * chunk
				if b == 1 {
					require.Equal(t, mems[l][(kv*n+block)*chunk:][:chunk], mems[l][off:off+chunk])
				} else {
					require.Equal(t, before[l][off:off+chunk], mems[l][off:off+chunk], "layer %d kv %d block %d changed", l, kv, b)
				}
			}
		}
	}
}

// TestBlocksMatchSingle: the batched walk moves exactly what Gather/Scatter do.
func TestBlocksMatchSingle(t *testing.T) {
	const n, bs, h, d, layers = 8, 2, 3, 4, 3
	var tensors []layout.Tensor
	for l := 0; l < layers; l++ {
		m := mmap(t, 2*n*bs*h*d)
		for i := range m {
			m[i] = byte(i*5 + l)
		}
		tensors = append(tensors, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&m[0])), Shape: []int64{n, 2, bs, h, d}})
	}
	e, err := layout.NewEngine(layout.Spec{Tensors: tensors, NumBlocks: n, BlockSize: bs, DtypeBytes: 1})
	require.NoError(t, err)
	blocks := []int{6, 1, 3}
	bufs := make([][]byte, len(blocks))
	wants := make([][]byte, len(blocks))
	for i, b := range blocks {
		bufs[i] = make([]byte, e.BytesPerBlock())
		wants[i] = make([]byte, e.BytesPerBlock())
		Gather(e, b, wants[i])
	}
	GatherBlocks(e, blocks, bufs)
	require.Equal(t, wants, bufs)
	// Scatter them to other blocks and read back one by one.
	targets := []int{0, 7, 2}
	ScatterBlocks(e, targets, bufs)
	for i, b := range targets {
		got := make([]byte, e.BytesPerBlock())
		Gather(e, b, got)
		require.Equal(t, bufs[i], got)
	}
}

func TestLimiter(t *testing.T) {
	for _, tc := range []struct{ n, batch, slots int }{{0, 4, 2}, {1, 4, 2}, {17, 4, 2}, {100, 1, 3}, {10, 0, 0}} {
		l := NewLimiter(tc.slots)
		var running, peak atomic.Int32
		var mu sync.Mutex
		seen := make([]int, tc.n)
		usedSlot := make(map[int]bool)
		l.Run(tc.n, tc.batch, func(slot, lo, hi int) {
			r := running.Add(1)
			for {
				p := peak.Load()
				if r <= p || peak.CompareAndSwap(p, r) {
					break
				}
			}
			mu.Lock()
			require.False(t, usedSlot[slot], "slot %d used by two batches at once", slot)
			usedSlot[slot] = true
			mu.Unlock()
			require.LessOrEqual(t, hi-lo, max(tc.batch, 1))
			for i := lo; i < hi; i++ {
				seen[i]++
			}
			mu.Lock()
			usedSlot[slot] = false
			mu.Unlock()
			running.Add(-1)
		})
		for i, c := range seen {
			require.Equal(t, 1, c, "item %d ran %d times", i, c)
		}
		require.LessOrEqual(t, int(peak.Load()), max(tc.slots, 1))
	}
}

func TestCopyChunk(t *testing.T) {
	src := mmap(t, 1<<16)
	dst := mmap(t, 1<<16+64)
	for i := range src {
		src[i] = byte(i*13 + i>>8)
	}
	for _, n := range []int{0, 1, 127, 4095, 4096, 4097, 5000, 32768, 1<<16 - 3} {
		for _, dOff := range []int{0, 1, 8, 15, 16, 33} {
			for _, sOff := range []int{0, 3} {
				if sOff+n > len(src) {
					continue
				}
				clear(dst)
				copyChunk(dst[dOff:dOff+n], src[sOff:sOff+n])
				require.Equal(t, src[sOff:sOff+n], dst[dOff:dOff+n], "n=%d dst+%d src+%d", n, dOff, sOff)
				require.Zero(t, bytes.Count(dst[:dOff], []byte{0})-dOff, "wrote before dst")
				require.Equal(t, len(dst)-dOff-n, bytes.Count(dst[dOff+n:], []byte{0}), "wrote past dst")
			}
		}
	}
}

// BenchmarkGather compares plain and non-temporal stores on the issue's
// FlashAttention shape (32 KiB chunks, 32 layers), gathering scattered blocks.
func BenchmarkGather(b *testing.B) {
	const layers, nb, chunk = 32, 256, 32 << 10
	mem, err := unix.Mmap(-1, 0, layers*2*nb*chunk, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	require.NoError(b, err)
	defer func() { _ = unix.Munmap(mem) }()
	var ts []layout.Tensor
	for l := 0; l < layers; l++ {
		ts = append(ts, layout.Tensor{Ptr: uintptr(unsafe.Pointer(&mem[l*2*nb*chunk])), Shape: []int64{2, nb, 16, 8, 128}})
	}
	e, err := layout.NewEngine(layout.Spec{Tensors: ts, NumBlocks: nb, BlockSize: 16, DtypeBytes: 2})
	require.NoError(b, err)
	host, err := unix.Mmap(-1, 0, nb*int(e.BytesPerBlock()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	require.NoError(b, err)
	defer func() { _ = unix.Munmap(host) }()
	bpb := int(e.BytesPerBlock())
	for _, nt := range []bool{false, true} {
		b.Run(map[bool]string{false: "plain", true: "nontemporal"}[nt], func(b *testing.B) {
			old := useNT
			useNT = nt
			defer func() { useNT = old }()
			b.SetBytes(int64(nb * bpb))
			for b.Loop() {
				for i := 0; i < nb; i++ {
					Gather(e, (i*97)%nb, host[i*bpb:(i+1)*bpb])
				}
			}
		})
	}
}
