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
- hybrid models (Mamba, SWA, DSA indexer pools): the controller registers
  every pool of its host pool group with ``register_mem_host_pool_v2`` and
  then ``on_host_pools_registered``; the side pools move through
  ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` with one
  ``PoolTransfer`` per pool (its keys, its host indices, its hit policy).
  Each pool gets a store of its own (its page size, its identity), sized as
  its share of the pools' host memory; ``trailing_pages`` pools (Mamba and
  SWA states) need only the last pages of a prefix, so the usable prefix
  lengths are those where every pool can serve its part
  (``PoolTransferResult.restorable_prefix_pages``).
- events: on the rank that publishes SGLang's KV events, with the
  consolidator on, a kvbm consolidator subscribes to SGLang's stream and
  publishes the merged one (its pages are announced under SGLang's own event
  hash of each page key; docs/design.md §6.3).

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
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

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
# kvbm's own keys of the extra config that are not environment settings.
# kv_events_endpoint: SGLang's KV event stream for the consolidator to
# subscribe to (default: the endpoint of SGLang's --kv-events-config).
_KVBM_KEYS = frozenset({"kv_events_endpoint"})

_FLAT_PAGE_METHODS = ("get_dummy_flat_data_page", "get_data_page", "set_from_flat_data_page", "page_size")

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
        if k in _SGLANG_KEYS or k in _KVBM_KEYS:
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
            f"takes DYN_KVBM_* settings (README 'With SGLang') besides {', '.join(sorted(_SGLANG_KEYS | _KVBM_KEYS))}"
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


class _Pool:
    """One registered host pool and its page store."""

    def __init__(self, name: Any, pool: Any):
        missing = [m for m in _FLAT_PAGE_METHODS if not hasattr(pool, m)]
        if missing:
            raise NotImplementedError(
                f"kvbm: SGLang host pool {type(pool).__name__} ({name!s}) has no flat pages (no "
                f"{', '.join(missing)}): kvbm stores pools that read and write whole pages"
            )
        self.name = name
        self.pool = pool
        self.page_size = int(pool.page_size) or 1
        # The flat page's size and dtype, from a page of the pool (its
        # get_dummy_flat_data_page allocates pinned memory, which needs CUDA).
        dummy = pool.get_data_page(0, flat=True)
        self.page_numel: int = int(dummy.numel())
        self.dtype = dummy.dtype
        self.page_bytes: int = int(dummy.numel() * dummy.element_size())
        self.store: Optional[PageStore] = None
        # Zero-copy when a page of the pool is a view of its buffer (SGLang's
        # KV pools): kvbm copies straight between the pool and the tier.
        # Pools whose pages are assembled (Mamba: conv and temporal states)
        # go through a flat page buffer and the pool's own set call.
        self.zero_copy = False
        try:
            page = pool.get_data_page(0, flat=False)
            buf = getattr(pool, "kv_buffer", None)
            self.zero_copy = (
                isinstance(buf, torch.Tensor)
                and page.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                and sum(n for _, n in segments(page)) == self.page_bytes
            )
        except Exception:  # noqa: BLE001  (an unusual pool: the staged path)
            self.zero_copy = False

    def host_bytes(self) -> int:
        """The pool's host memory: its slots times their bytes."""
        size, per = getattr(self.pool, "size", None), getattr(self.pool, "size_per_token", None)
        if isinstance(size, int) and isinstance(per, int) and size > 0 and per > 0:
            return int(size * per)
        return self.page_bytes


class KvbmHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend storing host pages in kvbm's disk tier."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self._env = kvbm_env(storage_config.extra_config)
        _check_config(self._env)
        self._pools: dict[Any, _Pool] = {}  # by pool name; PoolName.KV is the anchor
        self._opened = False
        self._consolidator: Any = None
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

    def _identity(self, pool: Any, page_bytes: int, name: Any = PoolName.KV) -> dict[str, Any]:
        c = self.storage_config
        ident = {
            "scheme": _IDENTITY_SCHEME,
            # The name (SGLang passes the model path, tagged with the host
            # pool's page format when it has one) with, for a local
            # checkpoint or a cached hub snapshot, its snapshot commit and a
            # digest of its config and weight-file heads: new weights under an
            # old path do not find the old weights' pages.
            "model": model_identity(c.model_name or ""),
            "tp_size": c.tp_size,
            # MLA KV is the same on every TP rank; Mamba state is sharded by
            # TP rank even then.
            "tp_rank": None if c.is_mla_model and name != PoolName.MAMBA else c.tp_rank,
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
            "page_size": int(pool.page_size),
            "page_bytes": page_bytes,
        }
        if name != PoolName.KV:  # the KV pool's identity is unchanged by hybrid support
            ident["pool_name"] = str(name)
        return ident

    def _file_rank(self) -> int:
        # One tier file per process: ranks that differ only by data
        # parallelism share the identity (their pages are interchangeable)
        # but not the file.
        c = self.storage_config
        return int(((c.dp_rank * c.pp_size + c.pp_rank) * c.attn_cp_size + c.attn_cp_rank) * c.tp_size + c.tp_rank)

    # -- SGLang hooks ------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if PoolName.KV not in self._pools:
            self._pools[PoolName.KV] = _Pool(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of a hybrid model's host pool group (the anchor KV pool
        again, Mamba, SWA, indexer, ...): stored in a store of its own. A
        pool registered after the first burst (a dynamic sidecar) opens its
        store at once."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = host_pool_name
        have = self._pools.get(name)
        if have is not None:
            if have.pool is not host_pool:
                raise ValueError(f"kvbm: SGLang host pool {name!s} registered twice with different pools")
            return
        entry = _Pool(name, host_pool)
        self._pools[name] = entry
        if self._opened:
            self._open(entry)

    def on_host_pools_registered(self) -> None:
        """Every pool is known: open their stores (a failure fails SGLang's
        attach) and, on the rank that publishes SGLang's KV events, the
        consolidator."""
        self._open_all()

    def _shares(self) -> dict[Any, float]:
        """Each pool's fraction of the disk tier's size: its share of the
        pools' host memory (the split SGLang chose for its host tier)."""
        if len(self._pools) <= 1:
            return {name: 0.0 for name in self._pools}  # 0: all of it
        total = sum(p.host_bytes() for p in self._pools.values())
        return {name: p.host_bytes() / total for name, p in self._pools.items()}

    def _open_all(self) -> None:
        if self._opened:
            return
        if PoolName.KV not in self._pools:
            raise RuntimeError("kvbm: HiCache storage used before register_mem_pool_host")
        self._opened = True
        try:
            self._consolidator = self._start_consolidator()
            shares = self._shares()
            for name, entry in self._pools.items():
                self._open(entry, shares[name])
        except BaseException:
            self._opened = False
            self.close()
            raise

    def _open(self, entry: _Pool, share: Optional[float] = None) -> None:
        if share is None:  # a late pool: its share of every pool's host memory
            total = sum(p.host_bytes() for p in self._pools.values())
            share = entry.host_bytes() / total
        identity = json.dumps(self._identity(entry.pool, entry.page_bytes, entry.name), sort_keys=True)
        entry.store = PageStore(
            identity, entry.page_bytes, rank=self._file_rank(), env=self._env, share=share, pool=str(entry.name),
            consolidator=self._consolidator if entry.name == PoolName.KV else None,
        )
        info = entry.store.info()
        log.info(
            "kvbm: SGLang HiCache storage (%s pool): %s, %d pages of %d bytes, %d recovered (persistent=%s)",
            entry.name, info["path"], info["num_pages"], entry.page_bytes, info["recovered"], info["persistent"],
        )

    def _need_pool(self, name: Any = PoolName.KV) -> _Pool:
        self._open_all()  # SGLang fires on_host_pools_registered; a caller that does not gets it here
        entry = self._pools.get(name)
        if entry is None or entry.store is None:
            raise ValueError(f"kvbm: SGLang host pool {name!s} was not registered with this storage backend")
        return entry

    def _need_store(self) -> PageStore:
        store = self._need_pool().store
        assert store is not None
        return store

    @property
    def _page_size(self) -> int:
        return self._need_pool().page_size

    # -- events ------------------------------------------------------------

    def _kv_events_source(self) -> Optional[tuple[str, int]]:
        """SGLang's KV event stream of this scheduler and its publisher's
        data-parallel index: the extra config's ``kv_events_endpoint`` (index:
        the storage config's dp_rank), else SGLang's --kv-events-config (its
        zmq publisher's endpoint, offset by that index as SGLang binds it), on
        the rank that publishes (pp, attention TP and CP rank 0); None
        elsewhere or without one."""
        extra = self.storage_config.extra_config or {}
        if extra.get("kv_events_endpoint"):
            return str(extra["kv_events_endpoint"]), int(self.storage_config.dp_rank or 0)
        try:
            from sglang.srt.disaggregation.kv_events import (
                KVEventsConfig,
                ZmqEventPublisher,
                is_kv_publisher_rank,
                select_kv_publisher_dp_rank,
            )
            from sglang.srt.runtime_context import get_observability, get_parallel

            raw = get_observability().kv_events_config
            if not raw or not is_kv_publisher_rank(raw):
                return None
            cfg = KVEventsConfig.from_cli(raw)
            if cfg.publisher != "zmq" or not cfg.endpoint:
                return None
            par = get_parallel()
            rank = select_kv_publisher_dp_rank(par.attn_dp_size, par.attn_dp_rank, par.dp_rank)
            ep = ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, rank)
            return (str(ep), int(rank)) if ep else None
        except Exception:  # noqa: BLE001  (no runtime context: not inside an SGLang scheduler)
            return None

    def _start_consolidator(self) -> Any:
        """kvbm's consolidator for SGLang's stream and this rank's disk tier
        (DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR, on by default; output on
        DYN_KVBM_KV_EVENTS_BIND_HOST : DYN_KVBM_LEADER_ZMQ_PUB_PORT + 1000 +
        the publisher's data-parallel index, as SGLang offsets its own, so
        that the schedulers of one host do not collide; NATS when
        NATS_SERVER is set), or None."""
        env = self._env
        if env.get("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "true").strip().lower() not in TRUTHY:
            return None
        source = self._kv_events_source()
        if source is None:
            return None
        endpoint, dp_index = source
        from kvbm._core import Consolidator
        from kvbm._envs import check_port

        port = check_port(int(env.get("DYN_KVBM_LEADER_ZMQ_PUB_PORT", "56001")) + 1000 + dp_index,
                          "DYN_KVBM_LEADER_ZMQ_PUB_PORT + 1000 + data-parallel index (consolidator output port)")
        host = env.get("DYN_KVBM_KV_EVENTS_BIND_HOST", "").strip() or "0.0.0.0"
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        opts: dict[str, Any] = {"engine": "sglang", "engine_endpoint": endpoint, "zmq_bind": f"tcp://{host}:{port}"}
        if env.get("NATS_SERVER"):
            opts["nats"] = True
            opts["nats_url"] = env["NATS_SERVER"]
        mode = env.get("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", "").strip()
        if mode:
            opts["mode"] = mode
        c = Consolidator(**opts)
        log.info("kvbm: consolidator for SGLang's KV events from %s, publishing on %s", endpoint,
                 c.stats()["zmq_endpoint"])
        return c

    def kvbm_consolidator(self) -> Any:
        """The consolidator this backend runs (None when it runs none)."""
        return self._consolidator

    # -- zero-copy interface (interface_v1) --------------------------------

    def _page_segments(self, index: int) -> list[tuple[int, int]]:
        """The host page at token ``index`` as (address, length) segments of
        the host pool's memory, in the order of its flat page
        (``get_data_page(flat=True)``, what ``set_from_flat_data_page`` takes):
        kvbm gathers and scatters them itself, no staging copy here."""
        return segments(self._need_pool().pool.get_data_page(index, flat=False))

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
            kv = self._need_pool()
            target_locations = [torch.empty(kv.page_numel, dtype=kv.dtype) for _ in keys]
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

    # -- hybrid pools (the v2 calls) ---------------------------------------

    def _transfer_pool(self, t: PoolTransfer) -> _Pool:
        return self._need_pool(t.name)

    def _pool_pages(self, entry: _Pool, keys: List[str], host_indices: Optional[torch.Tensor]
                    ) -> Optional[list[int]]:
        """The host slot of each key's page, or None when the indices do not
        cover the keys (one page of the pool's page size per key)."""
        if host_indices is None or host_indices.numel() != len(keys) * entry.page_size:
            log.warning("kvbm: HiCache %s pool: %d host indices for %d keys of %d slots each", entry.name,
                        0 if host_indices is None else host_indices.numel(), len(keys), entry.page_size)
            return None
        return [int(host_indices[i * entry.page_size]) for i in range(len(keys))]

    def _pool_io(self, entry: _Pool, keys: List[str], slots: list[int], put: bool) -> List[bool]:
        store = entry.store
        assert store is not None
        pool = entry.pool
        if entry.zero_copy:
            pages = [segments(pool.get_data_page(i, flat=False)) for i in slots]
            return store.put(keys, pages) if put else store.get(keys, pages)
        # Staged: the pool assembles (and takes back) its flat page itself.
        if put:
            flats = [pool.get_data_page(i, flat=True).contiguous() for i in slots]
            return store.put(keys, [[(f.data_ptr(), entry.page_bytes)] for f in flats])
        flats = [torch.empty(entry.page_numel, dtype=entry.dtype) for _ in slots]
        ok = store.get(keys, [[(f.data_ptr(), entry.page_bytes)] for f in flats])
        for hit, i, f in zip(ok, slots, flats):
            if hit:
                pool.set_from_flat_data_page(i, f)
        return ok

    def _batch_v2(self, transfers: List[PoolTransfer], put: bool) -> dict[Any, List[bool]]:
        out: dict[Any, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            entry = self._transfer_pool(t)
            if put and not self.storage_config.is_storage_writer and t.name != PoolName.MAMBA:
                # MLA's replicated pools: the writer rank stores them. Mamba
                # state is sharded by TP rank: every rank stores its own.
                out[t.name] = [True] * len(keys)
                continue
            slots = self._pool_pages(entry, keys, t.host_indices)
            if slots is None or not keys:
                out[t.name] = [False] * len(keys)
                continue
            out[t.name] = self._pool_io(entry, keys, slots, put)
        return out

    def batch_get_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        """Read each transfer's pages into its pool; per pool, one bool per
        key (a page that is missing or fails its checks is False and its
        slot is left as it was)."""
        return self._batch_v2(transfers, put=False)

    def batch_set_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> dict[str, List[bool]]:
        """Store each transfer's pages from its pool; per pool, one bool per key."""
        return self._batch_v2(transfers, put=True)

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The longest KV prefix every pool can serve. The KV pool's prefix
        is its run of stored pages from the first; then each transfer's pool
        keeps the prefix lengths it can serve: ``all_pages``: every page of
        the prefix stored; ``trailing_pages``: the last ``len(keys)`` pages
        of the prefix stored (a Mamba state or an SWA window ends there).
        ``restorable_prefix_pages`` lists every length all pools serve (a
        trailing pool can leave holes); ``kv_hit_pages`` is the longest."""
        kv = self._need_store().exists(keys)
        hits: dict[Any, int] = {PoolName.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            entry = self._transfer_pool(t)
            store = entry.store
            assert store is not None
            have = store.has(keys[:kv])
            run = [0]  # run[p]: pages of the first p that the pool holds
            for h in have:
                run.append(run[-1] + int(h))
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                serve = {p for p in range(1, kv + 1) if run[p] == p}
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                n = max(1, len(t.keys or ()))
                serve = {p for p in range(1, kv + 1) if run[p] - run[max(0, p - n)] == min(n, p)}
            else:
                raise ValueError(
                    f"kvbm: HiCache pool {t.name!s}: hit policy {getattr(t.hit_policy, 'value', t.hit_policy)} is not "
                    f"supported by kvbm's storage "
                    f"(all_pages and trailing_pages are)"
                )
            if serve:
                hits[t.name] = max(serve)
            restorable &= serve
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # -- housekeeping --------------------------------------------------------

    def clear(self) -> bool:
        for entry in self._pools.values():
            if entry.store is not None:
                entry.store.clear()
        return True

    def close(self) -> None:
        """Release the tier files (a persistent one is kept, synced) and stop
        the consolidator."""
        for entry in self._pools.values():
            if entry.store is not None:
                entry.store.close()
                entry.store = None
        self._opened = False
        if self._consolidator is not None:
            self._consolidator.close()
            self._consolidator = None

    def kvbm_info(self, pool: Any = PoolName.KV) -> dict[str, Any]:
        """A pool's store counters and tier file (the KV pool's by default)."""
        store = self._need_pool(pool).store
        assert store is not None
        return store.info()

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
