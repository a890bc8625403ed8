"""GPU data path: byte-exact round trips between torch-allocated CUDA KV caches
and kvbm's host (G2) and disk (G3) tiers, through the CUDA build of the
library (libkvbm_cuda.so, `make cuda`).

Skipped without torch, without a CUDA device, or when the CUDA variant of the
library is not the one loaded.
"""

from __future__ import annotations

import ctypes
import os
import random
from ctypes import POINTER, c_char_p, c_int, c_uint64

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from kvbm import _native  # noqa: E402
from kvbm._core import Worker  # noqa: E402
from kvbm import _plan  # noqa: E402

LAYERS, HEADS, DIM, BS, NBLOCKS = 4, 2, 64, 16, 96
MLA_LATENT = 72  # 576 in DeepSeek's models
N = 24  # blocks per round trip


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    _, variant = _native.library_path()
    if variant != "cuda":
        pytest.skip("the CUDA library is not selected (build it with `make cuda`)")
    _native.lib()
    if _native.loaded_variant() != "cuda":
        pytest.skip(f"another kvbm library variant ({_native.loaded_variant()}) is already loaded in this process")
    _native.register_signatures(
        {"kvbm_worker_set_cuda_stream": (c_int, [c_uint64, c_uint64, POINTER(c_char_p)])})


def driver_version():
    """The CUDA driver's version (12080 for 12.8)."""
    v = ctypes.c_int()
    assert ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0
    return v.value


def rand_bf16(shape):
    # Every 16-bit pattern (NaNs included): compared as int16, bit for bit.
    return torch.randint(-32768, 32768, shape, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)


class Cache:
    """An engine KV cache of one layout, with per-block views."""

    def __init__(self, kind, packed=False):
        self.kind = kind
        if kind == "flash_attn" and packed:
            # Layers back to back in one allocation (equally spaced).
            self.tensors = list(rand_bf16((LAYERS, 2, NBLOCKS, BS, HEADS, DIM)).unbind(0))
        elif kind == "flash_attn":
            self.tensors = [rand_bf16((2, NBLOCKS, BS, HEADS, DIM)) for _ in range(LAYERS)]
        elif kind == "flashinfer":
            self.tensors = [rand_bf16((NBLOCKS, 2, BS, HEADS, DIM)) for _ in range(LAYERS)]
        elif kind == "cpu_paged":  # vLLM 0.32's per-layer view [N, heads, bs, 2*head_dim], NHD in memory (LBNHC)
            self.tensors = [rand_bf16((NBLOCKS, BS, HEADS, 2 * DIM)).permute(0, 2, 1, 3) for _ in range(LAYERS)]
        elif kind == "mla":  # vLLM's MLA backends: one latent per token and layer
            self.tensors = [rand_bf16((NBLOCKS, BS, MLA_LATENT)) for _ in range(LAYERS)]
        else:  # trtllm: one pool [N, L, kv_factor, heads × block_size × head_dim]
            self.tensors = [rand_bf16((NBLOCKS, LAYERS, 2, HEADS * BS * DIM))]

    def block(self, b):
        """A copy of block b across all layers, as int16."""
        if self.kind == "flash_attn":
            parts = [t[:, b] for t in self.tensors]
        else:
            parts = [t[b] for t in self.tensors]
        return torch.stack([p.reshape(-1) for p in parts]).view(torch.int16).clone()

    def write(self, blocks, values):
        """Overwrite `blocks` with `values` (a list of tensors shaped like block views)."""
        idx = torch.tensor(blocks, device="cuda")
        for t, v in zip(self.tensors, values):
            if self.kind == "flash_attn":
                t[:, idx] = v
            else:
                t[idx] = v

    def random_values(self, n):
        if self.kind == "flash_attn":
            return [rand_bf16((2, n) + tuple(t.shape[2:])) for t in self.tensors]
        return [rand_bf16((n,) + tuple(t.shape[1:])) for t in self.tensors]

    def worker(self, tmp_path, mode):
        os.environ.update({
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
            "DYN_KVBM_CUDA_COPY": mode,
        })
        tensors = [(t.data_ptr(), list(t.shape), list(t.stride())) for t in self.tensors]
        return Worker(tensors=tensors, kind=self.kind, num_blocks=NBLOCKS, block_size=BS, dtype_bytes=2)


def copy(s, sb, d, db):
    return {"s": s, "sb": sb, "d": d, "db": db}


def set_stream(w, stream):
    _native.call("kvbm_worker_set_cuda_stream", w._h, stream.cuda_stream)


MODES = {"flash_attn": ["kernel", "staged", "batch", "split"], "flashinfer": ["kernel", "staged", "batch", "split"],
         "trtllm": ["direct", "kernel", "staged", "batch", "split", "auto"],
         "cpu_paged": ["kernel", "staged", "batch", "split", "auto"],
         "mla": ["kernel", "staged", "batch", "split", "auto"]}
CASES = [(k, m, via) for k, ms in MODES.items() for m in ms for via in ("g2", "g3")]


@pytest.mark.parametrize("kind,mode,via", CASES, ids=[f"{k}-{m}-{v}" for k, m, v in CASES])
def test_round_trip(tmp_path, kind, mode, via):
    """G1 → G2 (→ G3) → other G1 blocks, byte for byte, ordered after the
    engine's stream, while a third stream keeps rewriting other blocks."""
    torch.manual_seed(hash((kind, mode, via)) & 0xFFFF)
    cache = Cache(kind)
    perm = random.Random(1).sample(range(NBLOCKS), NBLOCKS)
    src, dst, busy = perm[:N], perm[N:2 * N], perm[2 * N:]
    w = cache.worker(tmp_path, mode)
    try:
        info = w.info()
        # batch and split fall back to staged on drivers without
        # cuMemcpyBatchAsync; auto picks split where they exist.
        want = {"batch": ("batch", "staged"), "split": ("split", "staged"),
                "auto": ("split", "staged")}.get(mode, (mode,))
        assert any(info["g1"].startswith("cuda:0 " + m) for m in want), info

        # The engine writes the source blocks late: after a ~20 ms sleep on
        # its stream. The save is issued at once and must still see them.
        engine = torch.cuda.Stream()
        new_values = cache.random_values(N)
        torch.cuda.synchronize()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(40_000_000)
            cache.write(src, new_values)
        set_stream(w, engine)

        # Another stream keeps rewriting unrelated blocks throughout.
        side = torch.cuda.Stream()
        busy_values = cache.random_values(len(busy))
        with torch.cuda.stream(side):
            for _ in range(200):
                cache.write(busy, busy_values)

        w.bind(_plan.encode_map({"q": 1, "v": [copy(1, b, 2, i) for i, b in enumerate(src)]}))
        w.wait_for_save()
        engine.synchronize()
        want = [cache.block(b) for b in src]
        tier, off = 2, 0
        if via == "g3":
            w.bind(_plan.encode_map({"q": 2, "m": [copy(2, i, 3, N + i) for i in range(N)]}))
            w.wait_for_save()
            w.bind(_plan.encode_map({"q": 3, "x": [copy(2, i, 0, 0) for i in range(N)]}))
            tier, off = 3, N
        w.bind(_plan.encode_map({"q": 4, "l": [{"r": f"r{i}", "c": [copy(tier, off + i, 1, b)]} for i, b in enumerate(dst)]}))
        w.start_load()
        w.wait_loads()
        loaded, failed = w.finished()
        assert sorted(loaded) == sorted(f"r{i}" for i in range(N))
        assert failed == []
        side.synchronize()
        for i, b in enumerate(dst):
            assert torch.equal(cache.block(b), want[i]), f"block {b} (from {src[i]}) differs"
    finally:
        w.close()


@pytest.mark.parametrize("mode,packed", [("", False), ("auto", False), ("", True)])
def test_default_mode_uses_copy_engines(tmp_path, mode, packed):
    """The default copy path crosses PCIe with the copy engines, never the
    zero-copy kernel that holds the SMs while it waits on PCIe: `split` with
    no fixed share (staged gather/scatter on a small fixed grid + DMA while
    the GPU is idle, the driver's batched copies while the engine's kernels
    hold the SMs), with one pitched copy per block where the layers are
    equally spaced, as when they share one allocation; `staged` where the
    driver has no batched copies; and it round-trips."""
    cache = Cache("flash_attn", packed=packed)
    w = cache.worker(tmp_path, mode)
    try:
        g1 = w.info()["g1"]
        if driver_version() >= 12080:  # the batched copies exist from CUDA 12.8 on
            assert g1.startswith("cuda:0 split") and "no fixed share" in g1, g1
            assert ("one pitched copy per block" in g1) == packed, g1
        else:
            assert g1.startswith("cuda:0 staged"), g1
        src, dst = list(range(10, 10 + N)), list(range(50, 50 + N))
        want = [cache.block(b) for b in src]
        w.bind(_plan.encode_map({"q": 1, "v": [copy(1, b, 2, i) for i, b in enumerate(src)]}))
        w.wait_for_save()
        w.bind(_plan.encode_map({"q": 2, "l": [{"r": f"r{i}", "c": [copy(2, i, 1, b)]} for i, b in enumerate(dst)]}))
        w.start_load()
        w.wait_loads()
        assert len(w.finished()[0]) == N
        for i, b in enumerate(dst):
            assert torch.equal(cache.block(b), want[i])
    finally:
        w.close()


GROUP_MODES = ["auto", "kernel", "staged", "batch", "split"]


@pytest.mark.parametrize("mode", GROUP_MODES)
def test_two_kv_cache_groups_round_trip_per_group(tmp_path, mode):
    """vLLM's hybrid KV cache manager on a GPU: two groups (full attention,
    sliding window) whose layer i shares tensor i, each group using its own
    blocks of it. A save stores layer l of each position from the block of
    l's group; a load writes each group's layers into that group's blocks,
    leaves a group given the null block (-1: before a sliding window)
    untouched, and touches no other block; through G2 and G3, every mode.
    The save is ordered after the engine's stream, which writes the blocks late."""
    tensors = [rand_bf16((2, NBLOCKS, BS, HEADS, DIM)) for _ in range(2)]
    os.environ.update({
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_CUDA_COPY": mode,
    })
    layers = [tensors[0], tensors[0], tensors[1], tensors[1]]  # layer order: full, sliding, full, sliding
    w = Worker(tensors=[(t.data_ptr(), list(t.shape), list(t.stride())) for t in layers], kind="flash_attn",
               num_blocks=NBLOCKS, block_size=BS, dtype_bytes=2, layer_groups=[0, 1, 0, 1],
               group_kinds=["full_attention", "sliding_window(32)"])
    try:
        full, sliding = list(range(1, 9)), list(range(20, 28))  # a request's blocks per group
        # The engine writes the request's blocks after a ~20 ms sleep on its stream.
        late = [rand_bf16((2, len(full) + len(sliding), BS, HEADS, DIM)) for _ in range(2)]
        engine = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(40_000_000)
            for t, v in zip(tensors, late):
                t[:, torch.tensor(full + sliding, device="cuda")] = v
        set_stream(w, engine)
        save = _plan.encode_map({"q": 1, "v": [copy(1, b, 2, i) for i, b in enumerate(full)]})
        w.bind(_plan.with_group_rows(save, 2, {b: [b, s] for b, s in zip(full, sliding)}))
        w.wait_for_save()
        engine.synchronize()
        want = [[tensors[i // 2][:, (full if i % 2 == 0 else sliding)[p]].clone() for i in range(4)]
                for p in range(len(full))]
        w.bind(_plan.encode_map({"q": 2, "m": [copy(2, 4 + i, 3, i) for i in range(4)]}))
        w.wait_for_save()
        w.bind(_plan.encode_map({"q": 3, "x": [copy(2, 4 + i, 0, 0) for i in range(4)]}))
        torch.cuda.synchronize()
        before = [t.clone() for t in tensors]
        # The loading request: full blocks 40.., its sliding group the null
        # block for the first two positions.
        lfull, lsliding = list(range(40, 48)), [-1, -1] + list(range(60, 66))
        loads = [copy(2, i, 1, lfull[i]) for i in range(4)] + [copy(3, i, 1, lfull[4 + i]) for i in range(4)]
        plan = _plan.encode_map({"q": 4, "l": [{"r": "r", "c": loads}]})
        w.bind(_plan.with_group_rows(plan, 2, {b: [b, s] for b, s in zip(lfull, lsliding)}))
        w.start_load()
        w.wait_loads()
        assert w.finished() == (["r"], [])
        torch.cuda.synchronize()
        touched = {(i, b) for i in range(2) for b in lfull} | {(i, b) for i in range(2) for b in lsliding if b >= 0}
        for p in range(8):
            for layer in range(4):
                blk = (lfull if layer % 2 == 0 else lsliding)[p]
                if blk >= 0:
                    got = tensors[layer // 2][:, blk].view(torch.int16)
                    assert torch.equal(got, want[p][layer].view(torch.int16)), (p, layer)
        for i in range(2):
            for b in range(NBLOCKS):
                if (i, b) not in touched:
                    assert torch.equal(tensors[i][:, b].view(torch.int16), before[i][:, b].view(torch.int16)), (i, b)
    finally:
        w.close()


def test_dropped_g2_block_fails_load(tmp_path):
    """A load from a G2 block that was dropped reports the G1 block as failed."""
    cache = Cache("flash_attn")
    w = cache.worker(tmp_path, "kernel")
    try:
        w.bind(_plan.encode_map({"q": 1, "v": [copy(1, 5, 2, 0)]}))
        w.wait_for_save()
        w.bind(_plan.encode_map({"q": 2, "x": [copy(2, 0, 0, 0)]}))
        w.bind(_plan.encode_map({"q": 3, "l": [{"r": "r", "c": [copy(2, 0, 1, 9)]}]}))
        w.start_load()
        w.wait_loads()
        assert w.finished() == (["r"], [9])
    finally:
        w.close()


def test_packed_kv_pool_lays_layers_out_for_pitched_copies(tmp_path):
    """KVBM_CUDA_PACK_KV_CACHE's pool (what the vLLM connector returns from
    get_mem_pool_context): per-layer tensors allocated one after another land
    ascending and equally spaced, which the caching allocator alone does not
    give, so `auto` moves their blocks with one pitched copy each."""
    from kvbm import _kvpool

    shape = (2, 1024, BS, HEADS, DIM)  # 8 MiB a layer: the allocator's large pool
    with _kvpool.packed_kv_allocations():
        tensors = [rand_bf16(shape) for _ in range(LAYERS)]
    ptrs = [t.data_ptr() for t in tensors]
    gaps = {b - a for a, b in zip(ptrs, ptrs[1:])}
    assert len(gaps) == 1 and gaps.pop() > 0, [hex(p) for p in ptrs]
    os.environ.update({
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * N),
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_CUDA_COPY": "",
    })
    w = Worker(tensors=[(t.data_ptr(), list(t.shape), list(t.stride())) for t in tensors], kind="flash_attn",
               num_blocks=shape[1], block_size=BS, dtype_bytes=2)
    try:
        g1 = w.info()["g1"]
        if driver_version() >= 12080:
            assert g1.startswith("cuda:0 split") and "one pitched copy per block" in g1, g1
    finally:
        w.close()
