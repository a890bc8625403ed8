"""SGLang HiCache storage: kvbm's backend against SGLang's own ``file`` backend,
same run, same directory (a subdirectory each), same host pool and pages.

Each backend is driven through the HiCacheController method SGLang uses for
it: kvbm (dynamic, ``interface_v1``) through ``_page_set_zero_copy`` /
``_page_get_zero_copy``, ``file`` through ``_generic_page_set`` /
``_generic_page_get``. Pages are written once (backup), then read back
(prefetch) ``--reads`` times; GB/s counts page bytes moved. kvbm's file uses
O_DIRECT unless ``--buffered`` (then both go through the page cache, as the
file backend always does: its reads come from memory when the pages fit).

Needs sglang (``pip install --no-deps sglang`` plus orjson, ipython, gguf:
.ci/python-deps.sh).

    python bench/sglang_hicache.py [--quick] [--dir DIR] [--buffered]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import rows  # noqa: E402  (bench/rows.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="directory for both backends (default: a temporary one)")
    ap.add_argument("--buffered", action="store_true", help="kvbm without O_DIRECT")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=32, help="tokens per page")
    ap.add_argument("--pages", type=int, default=0, help="pages per run (default 128, quick 32)")
    ap.add_argument("--reads", type=int, default=3)
    ap.add_argument("--layout", default="page_first")
    a = ap.parse_args()
    n_pages = a.pages or (32 if a.quick else 128)

    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    tokens = (n_pages + 1) * a.page
    k = tuple(torch.zeros(a.page, a.heads, a.head_dim, dtype=torch.bfloat16) for _ in range(a.layers))
    v = tuple(torch.zeros(a.page, a.heads, a.head_dim, dtype=torch.bfloat16) for _ in range(a.layers))

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=a.page, head_num=a.heads, head_dim=a.head_dim, v_head_dim=a.head_dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 1.0, 0, a.page, a.layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=a.page, host_token_capacity=2 * n_pages * a.page,
                                start_layer=0, end_layer=a.layers)
    src = pool.alloc(n_pages * a.page)
    dst = pool.alloc(n_pages * a.page)
    g = torch.Generator().manual_seed(0)
    numel = pool.get_dummy_flat_data_page().numel()
    for i in range(n_pages):
        pool.set_from_flat_data_page(int(src[i * a.page]), torch.randn(numel, generator=g).to(torch.bfloat16))
    page_bytes = numel * 2
    keys = [f"{i:064x}" for i in range(n_pages)]

    base = a.dir or tempfile.mkdtemp(prefix="kvbm-sglang-bench-")
    os.makedirs(base, mode=0o700, exist_ok=True)
    # Fresh directories: the file backend skips a page whose file exists.
    kvbm_dir = tempfile.mkdtemp(prefix="kvbm-", dir=base)
    file_dir = tempfile.mkdtemp(prefix="file-", dir=base)

    def cfg(extra):
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False,
                                    is_page_first_layout=a.layout == "page_first", model_name="bench/model",
                                    extra_config=extra)

    kvbm = StorageBackendFactory.create_backend("dynamic", cfg({
        "backend_name": "kvbm", "module_path": "kvbm.sglang_integration", "class_name": "KvbmHiCacheStorage",
        "interface_v1": 1, "DYN_KVBM_DISK_CACHE_DIR": kvbm_dir,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": n_pages, "DYN_KVBM_DISK_PERSIST": "false",
        "DYN_KVBM_DISK_DISABLE_O_DIRECT": "true" if a.buffered else "false"}), pool)
    kvbm.register_mem_pool_host(pool)
    file_be = HiCacheFile(cfg({"file_storage_path": file_dir}))
    file_be.register_mem_pool_host(pool)

    def ctl(backend):
        return types.SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                                     page_size=a.page)

    op = types.SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    runs = {
        "kvbm": (lambda: HiCacheController._page_set_zero_copy(ctl(kvbm), keys, src),
                 lambda: HiCacheController._page_get_zero_copy(ctl(kvbm), op, keys, dst)),
        "file": (lambda: HiCacheController._generic_page_set(ctl(file_be), keys, src),
                 lambda: HiCacheController._generic_page_get(ctl(file_be), op, keys, dst)),
    }
    want = [pool.get_data_page(int(src[i * a.page])).clone() for i in range(n_pages)]
    res = {}
    for name, (put, get) in runs.items():
        t0 = time.perf_counter()
        assert put(), f"{name}: backup failed"
        w = n_pages * page_bytes / (time.perf_counter() - t0) / 1e9
        best = 0.0
        for _ in range(a.reads):
            t0 = time.perf_counter()
            got = get()
            best = max(best, n_pages * page_bytes / (time.perf_counter() - t0) / 1e9)
            assert got == n_pages, f"{name}: {got} of {n_pages} pages read"
        for i in range(n_pages):
            assert torch.equal(pool.get_data_page(int(dst[i * a.page])).view(torch.int16),
                               want[i].view(torch.int16)), f"{name}: page {i} differs"
        res[name] = (w, best)
    kvbm.close()

    mode = "buffered" if a.buffered else "O_DIRECT"
    print(f"{n_pages} pages of {page_bytes / 2**20:.2f} MiB ({a.layout}), directory {base}; kvbm {mode}")
    print(f"{'backend':8} {'write GB/s':>11} {'read GB/s':>10}")
    for name, (w, r) in res.items():
        print(f"{name:8} {w:11.2f} {r:10.2f}")
    kw, kr = res["kvbm"]
    fw, fr = res["file"]
    rows.emit("sglang-hicache", f"page write GB/s ({mode})", f"{kw:.2f}", f"file {fw:.2f}", f"{kw / fw:.2f}x")
    rows.emit("sglang-hicache", f"page read GB/s ({mode})", f"{kr:.2f}", f"file {fr:.2f}", f"{kr / fr:.2f}x")


if __name__ == "__main__":
    main()
