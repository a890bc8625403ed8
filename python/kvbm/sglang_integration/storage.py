"""KvbmHiCacheStorage: SGLang HiCache's storage backend over kvbm's disk tier.

What SGLang hands the backend (sglang/srt/mem_cache/hicache_storage.py and its
caller managers/cache_controller.py, release 0.5.x):

- construction through ``StorageBackendFactory`` with the ``dynamic`` backend:
  ``cls(storage_config, kwargs)``; then ``register_mem_pool_host(host_pool)``.
  The page size is known only then, so the store opens there (a failure
  fails SGLang's attach).
- with ``"interface_v1": 1`` in the extra config, the zero-copy calls:
  ``batch_exists(keys)`` (how many keys from the first are held),
  ``batch_get_v1(keys, host_indices)`` / ``batch_set_v1(keys, host_indices)``
  (one bool per key; page i lives at ``host_indices[i * page_size]`` of the
  host pool). Without it, the generic ``batch_get`` / ``batch_set`` over flat
  page tensors, which this class implements as well.
- MLA models: every TP rank holds the same KV, and only the storage writer
  (``HiCacheStorageConfig.is_storage_writer``) backs pages up; the others
  skip ``batch_set_v1`` (SGLang does not call it for them).

Keys: SGLang's page keys are already content hashes (of the page's tokens and
its prefix). The store salts each with a fingerprint of this setup's identity
(model, TP/PP/CP/DCP layout, host page layout, dtype, page geometry), so two
setups whose pages are not interchangeable never share a key or a file.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvbm import _native
from kvbm._envs import TRUTHY
from kvbm._model_digest import model_identity
from kvbm._pagestore import PageStore

log = logging.getLogger("kvbm.sglang")

# Keys of SGLang's extra config that are SGLang's own (the dynamic loader's,
# the zero-copy switch, the prefetch knobs its controller pops before the
# backend sees the config) rather than kvbm settings.
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
})

# Bump when the identity's fields or their meaning change: old files are then
# kept but not reused.
_IDENTITY_SCHEME = "sglang-hicache/1"


def kvbm_env(extra_config: Optional[dict]) -> dict[str, str]:
    """kvbm's settings for the backend: the process's DYN_KVBM_* variables,
    overridden by ``DYN_KVBM_*`` keys of SGLang's extra config. Persistence
    is on unless DYN_KVBM_DISK_PERSIST says otherwise (an L3 that forgets
    everything at restart is the exception). Any other key is refused."""
    env = _native.env_snapshot()
    unknown = []
    for k, v in (extra_config or {}).items():
        if k in _SGLANG_KEYS:
            continue
        if not k.startswith("DYN_KVBM_"):
            unknown.append(k)
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        env[k] = str(v)
    if unknown:
        raise ValueError(
            f"kvbm: --hicache-storage-backend-extra-config: unknown key(s) {', '.join(sorted(unknown))}: kvbm "
            f"takes DYN_KVBM_* settings (README 'With SGLang') besides {', '.join(sorted(_SGLANG_KEYS))}"
        )
    env.setdefault("DYN_KVBM_DISK_PERSIST", "true")
    return env


def _check_config(env: dict[str, str]) -> None:
    """Fail at attach on any bad kvbm setting, naming it."""
    from ctypes import POINTER, byref, c_int64, c_uint8

    buf = POINTER(c_uint8)()
    n = c_int64()
    _native.call("kvbm_config_check", json.dumps(env).encode(), 0, byref(buf), byref(n))
    _native.take_buffer(buf, n)


def segments(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, length) runs of a strided CPU tensor's memory, in the order
    of its flattened elements. The innermost dimensions that are contiguous
    form one run; the outer ones enumerate the runs (page-first: K and V,
    two runs; layer-first: one per layer and half)."""
    if t.device.type != "cpu":
        raise ValueError(f"kvbm: host pages must be in CPU memory, not {t.device}")
    es = t.element_size()
    shape, stride = list(t.shape), list(t.stride())
    inner, k = 1, len(shape)
    while k > 0 and (stride[k - 1] == inner or shape[k - 1] == 1):
        inner *= shape[k - 1]
        k -= 1
    offsets = [0]
    for d in range(k):
        offsets = [o + i * stride[d] for o in offsets for i in range(shape[d])]
    base = t.data_ptr()
    return [(base + o * es, inner * es) for o in offsets]


class KvbmHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend storing host pages in kvbm's disk tier."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self._env = kvbm_env(storage_config.extra_config)
        _check_config(self._env)
        self._store: Optional[PageStore] = None
        self._page_size = 0
        self._page_numel = 0
        self._dtype: Optional[torch.dtype] = None
        self._metrics = storage_config.enable_storage_metrics
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        c = storage_config
        g4 = self._env.get("DYN_KVBM_OBJECT_ENABLED", "").strip().lower() in TRUTHY
        if c.is_mla_model and c.tp_size > 1 and not g4:
            # The disk tier is per process and only the writer rank backs
            # pages up: without the shared object tier the other ranks'
            # stores stay empty, and SGLang's prefetch takes the minimum hit
            # over the TP group.
            raise ValueError(
                "kvbm: an MLA model with tp_size > 1 needs the object tier (DYN_KVBM_OBJECT_ENABLED=1 and its "
                "DYN_KVBM_OBJECT_* settings): kvbm's disk tier is per rank and SGLang backs MLA pages up from one "
                "rank only, so the other ranks would find them only there"
            )

    # -- identity ----------------------------------------------------------

    def _identity(self, pool: Any, page_bytes: int) -> dict[str, Any]:
        c = self.storage_config
        return {
            "scheme": _IDENTITY_SCHEME,
            # The name (SGLang passes the model path, tagged with the host
            # pool's page format when it has one) with, for a local
            # checkpoint or a cached hub snapshot, its snapshot commit and a
            # digest of its config and weight-file heads: new weights under an
            # old path do not find the old weights' pages.
            "model": model_identity(c.model_name or ""),
            "tp_size": c.tp_size,
            # MLA KV is the same on every TP rank.
            "tp_rank": None if c.is_mla_model else c.tp_rank,
            "pp_size": c.pp_size,
            "pp_rank": c.pp_rank,
            "attn_cp_size": c.attn_cp_size,
            "attn_cp_rank": c.attn_cp_rank,
            "dcp_size": c.dcp_size,
            "dcp_rank": c.dcp_rank,
            "mla": c.is_mla_model,
            "split_heads": bool(c.should_split_heads),
            "tp_lcm_size": c.tp_lcm_size,
            "pool": type(pool).__name__,
            "layout": getattr(pool, "layout", None),
            "dtype": str(getattr(pool, "dtype", None)),
            "page_size": self._page_size,
            "page_bytes": page_bytes,
        }

    def _file_rank(self) -> int:
        # One tier file per process: ranks that differ only by data
        # parallelism share the identity (their pages are interchangeable)
        # but not the file.
        c = self.storage_config
        return int(((c.dp_rank * c.pp_size + c.pp_rank) * c.attn_cp_size + c.attn_cp_rank) * c.tp_size + c.tp_rank)

    # -- SGLang hooks ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._store is not None:
            return
        if not all(hasattr(mem_pool_host, m) for m in ("get_dummy_flat_data_page", "get_data_page",
                                                       "set_from_flat_data_page", "page_size")):
            raise NotImplementedError(
                f"kvbm: SGLang host pool {type(mem_pool_host).__name__} has no flat pages (a hybrid model's pool "
                f"group?): not supported yet; use kvbm with a model whose HiCache has one KV pool"
            )
        dummy = mem_pool_host.get_dummy_flat_data_page()
        self._page_size = int(mem_pool_host.page_size)
        self._page_numel = dummy.numel()
        self._dtype = dummy.dtype
        page_bytes = dummy.numel() * dummy.element_size()
        identity = json.dumps(self._identity(mem_pool_host, page_bytes), sort_keys=True)
        self._store = PageStore(identity, page_bytes, rank=self._file_rank(), env=self._env)
        info = self._store.info()
        log.info(
            "kvbm: SGLang HiCache storage: %s, %d pages of %d bytes, %d recovered (persistent=%s)",
            info["path"], info["num_pages"], page_bytes, info["recovered"], info["persistent"],
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        # Hybrid models (Mamba, SWA, DSA pools) register their pools here and
        # then use the v2 calls, which this backend does not implement yet:
        # fail the attach rather than the first prefetch.
        raise NotImplementedError(
            f"kvbm: SGLang's hybrid host pools (here {host_pool_name!s}) and the v2 storage calls are not "
            f"supported yet; use kvbm with a model whose HiCache has one KV pool"
        )

    def _need_store(self) -> PageStore:
        if self._store is None:
            raise RuntimeError("kvbm: HiCache storage used before register_mem_pool_host")
        return self._store

    # -- zero-copy interface (interface_v1) --------------------------------

    def _page_segments(self, index: int) -> list[tuple[int, int]]:
        """The host page at token ``index`` as (address, length) segments of
        the host pool's memory, in the order of its flat page
        (``get_data_page(flat=True)``, what ``set_from_flat_data_page`` takes):
        kvbm gathers and scatters them itself, no staging copy here."""
        return segments(self.mem_pool_host.get_data_page(index, flat=False))

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        if not keys:
            return []
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # the writer rank stores these pages
        store = self._need_store()
        t0 = time.perf_counter()
        ok = store.put(keys, [self._page_segments(int(host_indices[i * self._page_size])) for i in range(len(keys))])
        self._record(self._backup_pgs, self._backup_bw, sum(ok), t0)
        return ok

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        if not keys:
            return []
        store = self._need_store()
        t0 = time.perf_counter()
        ok = store.get(keys, [self._page_segments(int(host_indices[i * self._page_size])) for i in range(len(keys))])
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(ok), t0)
        return ok

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._need_store().exists(keys)

    # -- generic interface (without interface_v1) --------------------------

    def exists(self, key: str) -> bool:
        return self._need_store().exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[Optional[torch.Tensor]]:
        if not keys:
            return []
        store = self._need_store()
        if target_locations is None:
            target_locations = [torch.empty(self._page_numel, dtype=self._dtype) for _ in keys]
        targets = []
        for t in target_locations:
            if not t.is_contiguous() or t.numel() * t.element_size() != store.page_bytes:
                raise ValueError(f"kvbm: a target page must be contiguous and {store.page_bytes} bytes")
            targets.append(t)
        ok = store.get(keys, [[(t.data_ptr(), store.page_bytes)] for t in targets])
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if not keys:
            return True
        if not self.storage_config.is_storage_writer:
            return True
        store = self._need_store()
        if values is None or len(values) != len(keys):
            raise ValueError(f"kvbm: batch_set: {len(keys)} keys, values: {None if values is None else len(values)}")
        pages = [v.contiguous() for v in values]
        return all(store.put(keys, [segments(p) for p in pages]))

    # -- housekeeping --------------------------------------------------------

    def clear(self) -> bool:
        if self._store is not None:
            self._store.clear()
        return True

    def close(self) -> None:
        """Release the tier file (a persistent one is kept, synced)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def kvbm_info(self) -> dict[str, Any]:
        """The store's counters and tier file."""
        return self._need_store().info()

    def _record(self, pgs: list[int], bw: list[float], n: int, t0: float) -> None:
        if not self._metrics or n == 0:
            return
        dt = time.perf_counter() - t0
        pgs.append(n)
        bw.append(n * self._need_store().page_bytes / max(dt, 1e-9) / 1e9)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the pages moved since the last call
        (with --enable-storage-metrics), else None."""
        if not self._metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        m.prefetch_pgs.extend(self._prefetch_pgs)
        m.backup_pgs.extend(self._backup_pgs)
        m.prefetch_bandwidth.extend(self._prefetch_bw)
        m.backup_bandwidth.extend(self._backup_bw)
        for lst in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
            lst.clear()
        return m
