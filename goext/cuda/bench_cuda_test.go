//go:build cuda

package cuda

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/storage"
)

// BenchmarkCopier: the bench/gpu_transfer.py shape (32 layers × K/V × 16
// tokens × 8 heads × 128 × bf16 = 2 MiB blocks, 8192 G1 blocks, 2048 random
// blocks moved) through the copier alone, next to one contiguous DMA copy of
// the same bytes to page-locked memory (registered mmap and cuMemHostAlloc).
func BenchmarkCopier(b *testing.B) {
	needGPU(b)
	const layers, nblocks, moved = 32, 8192, 2048
	shape := []int64{2, nblocks, 16, 8, 128}
	per := int64(2 * nblocks * 16 * 8 * 128 * 2)
	spec := layout.Spec{Kind: layout.FlashAttn, NumBlocks: nblocks, BlockSize: 16, DtypeBytes: 2}
	var ptrs []cu.DevicePtr
	onCtx(b, func() error {
		for l := 0; l < layers; l++ {
			p, err := cu.MemAlloc(per)
			if err != nil {
				return err
			}
			if err := cu.MemsetD8(p, byte(l+1), per); err != nil {
				return err
			}
			ptrs = append(ptrs, p)
			spec.Tensors = append(spec.Tensors, layout.Tensor{Ptr: uintptr(p), Shape: shape})
		}
		return nil
	})
	defer onCtx(b, func() error {
		for _, p := range ptrs {
			_ = cu.MemFree(p)
		}
		return nil
	})
	eng, err := layout.NewEngine(spec)
	require.NoError(b, err)
	bpb := eng.BytesPerBlock()
	host, err := storage.NewHostRegion(moved, bpb, true)
	require.NoError(b, err)
	defer host.Close()
	perm := rand.New(rand.NewPCG(1, 2)).Perm(nblocks)
	src := perm[:moved]
	bufs := make([][]byte, moved)
	for i := range bufs {
		bufs[i] = host.Block(i)
	}
	total := int64(moved) * bpb
	type variant struct {
		m    Mode
		ctas int
	}
	for _, v := range []variant{{Kernel, 4}, {Staged, 0}, {Staged, 4}, {Staged, 32}} {
		m := v.m
		// Staged: ctas is the fixed grid (0: the default).
		c, err := New(eng, Options{Mode: m, CTAsPerSM: v.ctas, StagedCTAs: v.ctas})
		require.NoError(b, err)
		require.NoError(b, c.RegisterHost(host))
		m2 := fmt.Sprintf("%s_ctas%d", m, v.ctas)
		b.Run(fmt.Sprintf("%s/offload", m2), func(b *testing.B) {
			b.SetBytes(total)
			for i := 0; i < b.N; i++ {
				require.NoError(b, c.GatherBlocks(src, bufs))
			}
		})
		b.Run(fmt.Sprintf("%s/onboard", m2), func(b *testing.B) {
			b.SetBytes(total)
			for i := 0; i < b.N; i++ {
				require.NoError(b, c.ScatterBlocks(perm[moved:2*moved], bufs))
			}
		})
		require.NoError(b, c.Close())
	}

	// Contiguous baselines: one DMA copy of `total` bytes each way.
	var dev cu.DevicePtr
	onCtx(b, func() error { dev, err = cu.MemAlloc(total); return err })
	defer onCtx(b, func() error { return cu.MemFree(dev) })
	var alloc uintptr
	onCtx(b, func() error { alloc, err = hostAlloc(total); return err })
	defer onCtx(b, func() error { return hostFree(alloc) })
	var regBase uintptr
	onCtx(b, func() error {
		regBase = uintptr(unsafe.Pointer(&host.IOBlock(0)[0]))
		_, err := hostRegister(regBase, host.Stride()*int64(host.NumBlocks()))
		return err
	})
	defer onCtx(b, func() error { return hostUnregister(regBase) })
	for _, hc := range []struct {
		name string
		p    uintptr
	}{{"registered_mmap", regBase}, {"cuMemHostAlloc", alloc}} {
		for _, toDev := range []bool{false, true} {
			name := "contiguous/" + hc.name + "/dtoh"
			if toDev {
				name = "contiguous/" + hc.name + "/htod"
			}
			b.Run(name, func(b *testing.B) {
				b.SetBytes(total)
				onCtx(b, func() error {
					s, err := cu.MakeStream(cu.NonBlocking)
					if err != nil {
						return err
					}
					defer s.Destroy()
					for i := 0; i < b.N; i++ {
						if toDev {
							err = cu.MemcpyHtoDAsync(dev, unsafePtr(hc.p), total, s)
						} else {
							err = cu.MemcpyDtoHAsync(unsafePtr(hc.p), dev, total, s)
						}
						if err != nil {
							return err
						}
						if err := s.Synchronize(); err != nil {
							return err
						}
					}
					return nil
				})
			})
		}
	}
}

// BenchmarkRows: a hybrid model's KV cache as vLLM's hybrid manager lays it
// out (32 layers in two KV cache groups, layer 2i of group 0 and layer 2i+1
// of group 1 sharing tensor i, each group using its own blocks; the
// BenchmarkCopier block shape) moved per group with GatherRows/ScatterRows,
// 2048 random positions, next to the same bytes of a one-group engine moved
// with GatherBlocks/ScatterBlocks in Auto and Batch mode, same run.
func BenchmarkRows(b *testing.B) {
	needGPU(b)
	const layers, nblocks, moved = 32, 8192, 2048
	shape := []int64{2, nblocks, 16, 8, 128}
	per := int64(2 * nblocks * 16 * 8 * 128 * 2)
	var ptrs []cu.DevicePtr
	alloc := func(n int) []layout.Tensor {
		var ts []layout.Tensor
		onCtx(b, func() error {
			for i := 0; i < n; i++ {
				p, err := cu.MemAlloc(per)
				if err != nil {
					return err
				}
				if err := cu.MemsetD8(p, byte(i+1), per); err != nil {
					return err
				}
				ptrs = append(ptrs, p)
				ts = append(ts, layout.Tensor{Ptr: uintptr(p), Shape: shape})
			}
			return nil
		})
		return ts
	}
	defer onCtx(b, func() error {
		for _, p := range ptrs {
			_ = cu.MemFree(p)
		}
		return nil
	})
	shared := alloc(layers / 2)
	var tensors []layout.Tensor
	groups := make([]int, layers)
	for l := 0; l < layers; l++ {
		tensors, groups[l] = append(tensors, shared[l/2]), l%2
	}
	hybrid, err := layout.NewEngine(layout.Spec{Kind: layout.FlashAttn, Tensors: tensors, NumBlocks: nblocks,
		BlockSize: 16, DtypeBytes: 2, LayerGroups: groups})
	require.NoError(b, err)
	one, err := layout.NewEngine(layout.Spec{Kind: layout.FlashAttn, Tensors: alloc(layers), NumBlocks: nblocks,
		BlockSize: 16, DtypeBytes: 2})
	require.NoError(b, err)
	bpb := hybrid.BytesPerBlock()
	host, err := storage.NewHostRegion(moved, bpb, true)
	require.NoError(b, err)
	defer host.Close()
	bufs := make([][]byte, moved)
	for i := range bufs {
		bufs[i] = host.Block(i)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	perm := rng.Perm(nblocks)
	rows := make([][]int64, moved)
	for i := range rows {
		rows[i] = []int64{int64(perm[i]), int64(perm[moved+i])}
	}
	total := int64(moved) * bpb
	c, err := New(hybrid, Options{})
	require.NoError(b, err)
	require.NoError(b, c.RegisterHost(host))
	b.Run("two_groups_rows/offload", func(b *testing.B) {
		b.SetBytes(total)
		for i := 0; i < b.N; i++ {
			require.NoError(b, c.GatherRows(rows, bufs))
		}
	})
	b.Run("two_groups_rows/onboard", func(b *testing.B) {
		b.SetBytes(total)
		for i := 0; i < b.N; i++ {
			require.NoError(b, c.ScatterRows(rows, bufs))
		}
	})
	require.NoError(b, c.Close())
	for _, m := range []Mode{Auto, Batch} {
		c, err := New(one, Options{Mode: m})
		require.NoError(b, err)
		require.NoError(b, c.RegisterHost(host))
		b.Run(fmt.Sprintf("one_group_%s/offload", m), func(b *testing.B) {
			b.SetBytes(total)
			for i := 0; i < b.N; i++ {
				require.NoError(b, c.GatherBlocks(perm[:moved], bufs))
			}
		})
		b.Run(fmt.Sprintf("one_group_%s/onboard", m), func(b *testing.B) {
			b.SetBytes(total)
			for i := 0; i < b.N; i++ {
				require.NoError(b, c.ScatterBlocks(perm[moved:2*moved], bufs))
			}
		})
		require.NoError(b, c.Close())
	}
}
