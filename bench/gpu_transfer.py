"""GPU ⇄ host KV block transfers through kvbm's CUDA data path (device machine).

Model shape: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks
(32 KiB per K or V chunk, 2 MiB per block), 8,192 G1 blocks. Offloads 2,048
random G1 blocks to G2 (bind + wait_for_save) and onboards them into 2,048
other G1 blocks (bind + start_load + wait_loads), through the real worker
(C ABI → Go → CUDA), and checks the bytes. The clock covers the data path
(wait_for_save; start_load until finished() reports the loads); binding the
plan (decoding it, done in bind_connector_metadata) is printed apart. Next to it, in the same run:
  (a) torch's pinned contiguous copy of the same number of bytes, each way;
  (b) naive per-block, per-layer torch copies into/out of pinned memory.
GB/s = 10^9 bytes per second of moved payload (2,048 × 2 MiB = 4.29 GB).

    PYTHONPATH=python python3 bench/gpu_transfer.py [--layouts flash_attn,flashinfer,trtllm]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from ctypes import POINTER, c_char_p, c_int, c_uint64

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

try:
    import torch
except ImportError:
    print("gpu_transfer: torch is not installed; skipped")
    sys.exit(0)
if not torch.cuda.is_available():
    print("gpu_transfer: no CUDA device; skipped")
    sys.exit(0)


from kvbm import _native  # noqa: E402
from kvbm._core import Worker  # noqa: E402
from kvbm import _plan  # noqa: E402

LAYERS, HEADS, DIM, BS = 32, 8, 128, 16


def make_cache(kind, nblocks):
    def t(shape):
        return torch.empty(shape, dtype=torch.bfloat16, device="cuda")

    if kind == "flash_attn":
        return [t((2, nblocks, BS, HEADS, DIM)) for _ in range(LAYERS)]
    if kind == "flashinfer":
        return [t((nblocks, 2, BS, HEADS, DIM)) for _ in range(LAYERS)]
    return [t((nblocks, LAYERS, 2, HEADS * BS * DIM))]


def refill(tensors):
    for t in tensors:
        t.view(torch.int16).random_()
    torch.cuda.synchronize()


def block_views(kind, tensors, b):
    """Per-layer views of block b (what a naive copier copies one by one)."""
    if kind == "flash_attn":
        return [t[:, b] for t in tensors]
    if kind == "flashinfer":
        return [t[b] for t in tensors]
    return [tensors[0][b, l] for l in range(LAYERS)]


def block_bytes(kind, tensors, b):
    return torch.cat([v.reshape(-1) for v in block_views(kind, tensors, b)]).view(torch.int16)


def timed(fn, repeat):
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes, secs):
    return nbytes / 1e9 / statistics.median(secs)


def bench_pinned(nbytes, repeat):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 256)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), repeat)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), repeat)
    del dev, host
    return gbps(nbytes, d2h), gbps(nbytes, h2d)


def bench_naive(kind, tensors, src, dst, bpb):
    """One torch copy per block per layer (K and V together where adjacent)."""
    n = len(src)
    refill(tensors)
    host = torch.empty((n, LAYERS, bpb // LAYERS // 2), dtype=torch.int16, pin_memory=True)

    def off():
        for i, b in enumerate(src):
            for l, v in enumerate(block_views(kind, tensors, b)):
                host[i, l].view(v.shape).view(torch.bfloat16).copy_(v, non_blocking=True)

    def on():
        for i, b in enumerate(dst):
            for l, v in enumerate(block_views(kind, tensors, b)):
                v.copy_(host[i, l].view(torch.bfloat16).view(v.shape), non_blocking=True)

    t_off, t_on = timed(off, 1), timed(on, 1)
    for k in random.Random(3).sample(range(n), 16):
        assert torch.equal(block_bytes(kind, tensors, src[k]), block_bytes(kind, tensors, dst[k])), "naive copy mismatch"
    del host
    return gbps(n * bpb, t_off), gbps(n * bpb, t_on)


def bench_kvbm(kind, tensors, nblocks, src, dst, mode, repeat):
    n = len(src)
    refill(tensors)  # no destination may already hold the expected bytes
    os.environ.update({
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(n),
        "DYN_KVBM_CUDA_COPY": mode,
    })
    os.environ.pop("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", None)
    t0 = time.perf_counter()
    w = Worker(tensors=[(t.data_ptr(), list(t.shape), list(t.stride())) for t in tensors], kind=kind,
               num_blocks=nblocks, block_size=BS, dtype_bytes=2)
    setup = time.perf_counter() - t0
    try:
        info = w.info()
        bpb = info["bytes_per_block"]
        _native.call("kvbm_worker_set_cuda_stream", w._h, torch.cuda.current_stream().cuda_stream)
        seq = [0]

        def step(**kw):
            seq[0] += 1
            return _plan.encode_map({"q": seq[0], **kw})

        save = {"v": [{"s": 1, "sb": b, "d": 2, "db": i} for i, b in enumerate(src)]}
        load = {"l": [{"r": f"r{i}", "c": [{"s": 2, "sb": i, "d": 1, "db": b}]} for i, b in enumerate(dst)]}

        phases = {"bind_save": [], "bind_load": [], "finished": []}

        # The plan is bound (decoded) before the clock starts: an engine
        # binds it in bind_connector_metadata, before the forward pass; its
        # cost is printed apart. Timed: the data path, i.e. wait_for_save,
        # and start_load until finished() reports the loads.
        def bind(which, plan):
            t0 = time.perf_counter()
            w.bind(step(**plan))
            phases[which].append(time.perf_counter() - t0)

        def off():
            w.wait_for_save()

        def on():
            w.start_load()
            w.wait_loads()
            t0 = time.perf_counter()
            loaded, failed = w.finished()
            phases["finished"].append(time.perf_counter() - t0)
            assert len(loaded) == n and not failed, (len(loaded), failed[:5])

        t_off, t_on = [], []
        for _ in range(repeat):
            bind("bind_save", save)
            t_off += timed(off, 1)
            bind("bind_load", load)
            t_on += timed(on, 1)
        for k in random.Random(5).sample(range(n), 64):
            assert torch.equal(block_bytes(kind, tensors, src[k]), block_bytes(kind, tensors, dst[k])), \
                f"{kind}/{mode}: block {dst[k]} differs from {src[k]}"
        print("    " + ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ms" for k, v in phases.items())
              + f"; offload {1e3 * statistics.median(t_off):.1f} ms, onboard {1e3 * statistics.median(t_on):.1f} ms", flush=True)
        return gbps(n * bpb, t_off), gbps(n * bpb, t_on), info["g1"], setup, bpb
    finally:
        w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--moved", type=int, default=2048)
    ap.add_argument("--layouts", default="flash_attn,flashinfer,trtllm")
    ap.add_argument("--modes", default="kernel,staged", help="kvbm modes for per-layer layouts (trtllm adds direct)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    path, variant = _native.library_path()
    if variant != "cuda":
        print(f"gpu_transfer: the CUDA library is not selected ({path}); build it with `make cuda`")
        sys.exit(1)
    _native.register_signatures({"kvbm_worker_set_cuda_stream": (c_int, [c_uint64, c_uint64, POINTER(c_char_p)])})
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, kvbm {_native.version()}")

    rng = random.Random(42)
    perm = rng.sample(range(args.blocks), 2 * args.moved)
    src, dst = perm[:args.moved], perm[args.moved:]
    bpb = LAYERS * 2 * BS * HEADS * DIM * 2
    nbytes = args.moved * bpb
    rows = []
    a_off, a_on = bench_pinned(nbytes, args.repeat)
    rows.append(("(a) torch pinned contiguous", "-", a_off, a_on))
    for kind in args.layouts.split(","):
        tensors = make_cache(kind, args.blocks)
        torch.cuda.synchronize()
        modes = args.modes.split(",") + (["direct"] if kind == "trtllm" else [])
        for mode in modes:
            off, on, g1, setup, got_bpb = bench_kvbm(kind, tensors, args.blocks, src, dst, mode, args.repeat)
            assert got_bpb == bpb
            rows.append((f"kvbm {kind}", mode, off, on))
            print(f"  {kind}/{mode}: {g1}; worker setup (pin {nbytes / 2**30:.1f} GiB) {setup:.2f} s", flush=True)
        n_off, n_on = bench_naive(kind, tensors, src, dst, bpb)
        rows.append((f"(b) naive torch {kind}", "per block+layer", n_off, n_on))
        del tensors
        torch.cuda.empty_cache()

    print(f"\n{args.moved} random blocks of {bpb // 1024} KiB ({nbytes / 1e9:.2f} GB) out of {args.blocks}; "
          f"median of {args.repeat} (naive: 1 run)")
    print(f"| {'path':32} | {'mode':15} | {'offload GB/s':>12} | {'% of (a)':>8} | {'onboard GB/s':>12} | {'% of (a)':>8} |")
    print(f"|{'-' * 34}|{'-' * 17}|{'-' * 14}|{'-' * 10}|{'-' * 14}|{'-' * 10}|")
    for name, mode, off, on in rows:
        print(f"| {name:32} | {mode:15} | {off:12.1f} | {100 * off / a_off:7.0f}% | {on:12.1f} | {100 * on / a_on:7.0f}% |")


if __name__ == "__main__":
    main()
