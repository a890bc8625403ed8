"""kvbm as SGLang HiCache's storage for hybrid models, against SGLang's real
classes: a host pool group (``HostPoolGroup``) of the KV pool, a Mamba state
pool (``MambaPoolHost``) and an SWA pool, on CPU tensors, registered as
SGLang's hybrid controller registers them; pages move through the hybrid
controller's own methods (``HybridCacheController._page_backup``,
``_storage_hit_query``, ``_page_transfer``), called on a controller object
that holds only what they read (its ``__init__``, which needs a device and
process groups, is not run).

Run by tests/test_sglang_backend.py in the SGLang test process, with
tests/sglang_contract.py.
"""

from __future__ import annotations

import os
import queue
import types

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401
sglang = pytest.importorskip("sglang", reason="sglang not installed: .ci/python-deps.sh installs it (--no-deps)")

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from sglang_contract import PAGE, _corrupt_payload, _no_ambient_kvbm_env, host_pool, storage_config  # noqa: E402,F401

SWA_WINDOW = 2  # pages an SWA window covers (its trailing keys)
MAMBA_LAYERS, MAMBA_SLOTS = 2, 8


def mamba_pool() -> MambaPoolHost:
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, 16, 3, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu",
                         layout="page_first")


def pool_group() -> HostPoolGroup:
    ident = lambda layer: layer  # noqa: E731
    return HostPoolGroup([
        PoolEntry(PoolName.KV, host_pool("page_first"), None, ident, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, mamba_pool(), None, ident),
        PoolEntry(PoolName.SWA, host_pool("page_first"), None, ident),
    ])


def attach_hybrid(cfg, group: HostPoolGroup):
    """HybridCacheController.attach_storage_backend's calls: the factory with
    the anchor pool, its registration, every entry through v2, then
    on_host_pools_registered."""
    anchor = group.anchor_entry.host_pool
    backend = StorageBackendFactory.create_backend("dynamic", cfg, anchor)
    backend.register_mem_pool_host(anchor)
    for entry in group.entries:
        backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    backend.on_host_pools_registered()
    return backend


def controller(backend, group: HostPoolGroup) -> HybridCacheController:
    ctl = HybridCacheController.__new__(HybridCacheController)
    ctl.storage_backend = backend
    ctl.mem_pool_host = group
    ctl.storage_host_pool = group.anchor_entry.host_pool
    ctl.page_size = PAGE
    ctl.storage_config = backend.storage_config  # backup_skip: not the storage writer
    ctl.storage_backend_type = "dynamic"
    ctl.page_set_func = ctl._page_set_zero_copy
    ctl.page_get_func = ctl._page_get_zero_copy
    ctl.prefetch_sync_queue = queue.Queue()
    return ctl


def fill(pool, indices: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    step = pool.page_size
    for i in range(0, len(indices), step):
        dummy = pool.get_dummy_flat_data_page()
        page = torch.randint(0, 256, (dummy.numel() * dummy.element_size(),), generator=g, dtype=torch.uint8)
        pool.set_from_flat_data_page(int(indices[i]), page.view(dummy.dtype))


def page_bytes(pool, indices: torch.Tensor) -> list[bytes]:
    step = pool.page_size
    return [pool.get_data_page(int(indices[i]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(0, len(indices), step)]


def side_transfers(mamba_idx=None, swa_idx=None, keys=None) -> list[PoolTransfer]:
    """The side pools' transfers as SGLang's tree builds them: a Mamba state
    (one trailing page) and an SWA window (SWA_WINDOW trailing pages)."""
    return [
        PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_idx, keys=keys[-1:] if keys else ["__placeholder__"],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.SWA, host_indices=swa_idx,
                     keys=keys[-SWA_WINDOW:] if keys else ["__placeholder__"] * SWA_WINDOW,
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]


def backup(ctl, group, keys, prefix_keys, seed):
    """Back a span of pages up with the Mamba state and SWA window at its
    end: what the controller's _page_backup does with the tree's transfers."""
    kv, mamba, swa = (group.get_pool(n) for n in (PoolName.KV, PoolName.MAMBA, PoolName.SWA))
    kv_idx, m_idx, s_idx = kv.alloc(len(keys) * PAGE), mamba.alloc(1), swa.alloc(SWA_WINDOW * PAGE)
    fill(kv, kv_idx, seed)
    fill(mamba, m_idx, seed + 1)
    fill(swa, s_idx, seed + 2)
    op = StorageOperation(kv_idx, [0] * (len(keys) * PAGE), hash_value=keys, prefix_keys=prefix_keys,
                          pool_transfers=side_transfers(m_idx, s_idx, keys))
    HybridCacheController._page_backup(ctl, op)
    assert op.completed_tokens == len(keys) * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1, PoolName.SWA: SWA_WINDOW}
    return page_bytes(kv, kv_idx), page_bytes(mamba, m_idx), page_bytes(swa, s_idx)


def hit_query(ctl, tokens):
    op = PrefetchOperation(types.SimpleNamespace(rid="r"), tokens, pool_transfers=side_transfers())
    keys, hit_tokens = HybridCacheController._storage_hit_query(ctl, op)
    return op, keys, hit_tokens


def prefetch(ctl, group, op, keys):
    """Load a hit: KV pages, then the side pools' trailing pages."""
    kv, mamba, swa = (group.get_pool(n) for n in (PoolName.KV, PoolName.MAMBA, PoolName.SWA))
    op.hash_value = keys
    op.host_indices = kv.alloc(len(keys) * PAGE)
    fill(kv, op.host_indices, 99)
    op.pool_transfers[0].host_indices = mamba.alloc(1)
    op.pool_transfers[1].host_indices = swa.alloc(SWA_WINDOW * PAGE)
    for t in op.pool_transfers:
        fill(group.get_pool(t.name), t.host_indices, 98)
    before = {t.name: page_bytes(group.get_pool(t.name), t.host_indices) for t in op.pool_transfers}
    HybridCacheController._page_transfer(ctl, op)
    acks = []
    while not ctl.prefetch_sync_queue.empty():
        acks.append(ctl.prefetch_sync_queue.get())
    sidecar = acks[-1]
    return (page_bytes(kv, op.host_indices), page_bytes(mamba, op.pool_transfers[0].host_indices),
            page_bytes(swa, op.pool_transfers[1].host_indices), sidecar.pool_hits, before, acks[0].completed_tokens)


def test_hybrid_pools_backup_hit_query_prefetch_restart(tmp_path):
    group = pool_group()
    cfg = storage_config(tmp_path, "page_first", extra={"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 256})
    backend = attach_hybrid(cfg, group)
    ctl = controller(backend, group)
    for name in (PoolName.KV, PoolName.MAMBA, PoolName.SWA):
        assert backend.kvbm_info(name)["num_pages"] > 0
    paths = {backend.kvbm_info(n)["path"] for n in (PoolName.KV, PoolName.MAMBA, PoolName.SWA)}
    assert len(paths) == 3, "one tier file per pool"

    tokens = list(range(500, 500 + 5 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    assert len(keys) == 5
    # Two backups of one request, as the tree offloads two nodes: pages 0-1
    # (states at page 2), then 2-4 (states at page 5).
    first = backup(ctl, group, keys[:2], None, seed=1)
    second = backup(ctl, group, keys[2:], keys[:2], seed=10)

    op, hit_keys, hit_tokens = hit_query(ctl, tokens + list(range(7, 7 + 2 * PAGE)))
    assert hit_keys == keys and hit_tokens == 5 * PAGE
    # Mamba and SWA can be restored at the end of either node only.
    assert op.pool_storage_result.restorable_prefix_pages == [2, 5]
    assert op.query_pool_hit_pages == {PoolName.KV: 5, PoolName.MAMBA: 5, PoolName.SWA: 5}

    kv_got, mamba_got, swa_got, pool_hits, _, done = prefetch(ctl, group, op, hit_keys)
    assert done == 5 * PAGE
    assert kv_got == first[0] + second[0]
    assert mamba_got == second[1] and swa_got == second[2], "the states of the second node, byte-exact"
    assert pool_hits == {PoolName.MAMBA: 1, PoolName.SWA: SWA_WINDOW}

    # A request ending inside the second node: its states are at the first
    # node's end, so the usable hit is the first node.
    op, hit_keys, hit_tokens = hit_query(ctl, tokens[: 4 * PAGE])
    assert hit_tokens == 2 * PAGE and op.pool_storage_result.restorable_prefix_pages == [2]
    backend.close()

    # A restart: new pools, new backend, the same directory.
    group2 = pool_group()
    backend2 = attach_hybrid(cfg, group2)
    ctl2 = controller(backend2, group2)
    assert backend2.kvbm_info(PoolName.MAMBA)["recovered"] == 2
    op, hit_keys, _ = hit_query(ctl2, tokens)
    assert op.pool_storage_result.restorable_prefix_pages == [2, 5]
    kv_got, mamba_got, swa_got, pool_hits, _, _ = prefetch(ctl2, group2, op, hit_keys)
    assert kv_got == first[0] + second[0] and mamba_got == second[1] and swa_got == second[2]
    backend2.close()


def test_corrupt_side_pool_page_is_missing_never_returned(tmp_path):
    group = pool_group()
    cfg = storage_config(tmp_path, "page_first", extra={"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 256})
    backend = attach_hybrid(cfg, group)
    ctl = controller(backend, group)
    tokens = list(range(900, 900 + 3 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    backup(ctl, group, keys, None, seed=3)
    info = backend.kvbm_info(PoolName.MAMBA)
    stride = -(-info["page_bytes"] // 4096) * 4096
    _corrupt_payload(info["path"], 4096 + stride, 4096, 0)  # the only Mamba page: slot 0

    op, hit_keys, _ = hit_query(ctl, tokens)
    assert op.pool_storage_result.restorable_prefix_pages == [3], "the store has not read the page yet"
    _, mamba_got, _, pool_hits, before, _ = prefetch(ctl, group, op, hit_keys)
    assert PoolName.MAMBA not in pool_hits or pool_hits[PoolName.MAMBA] == 0
    assert mamba_got == before[PoolName.MAMBA], "the corrupt state is not written to the slot"
    assert backend.kvbm_info(PoolName.MAMBA)["corrupt"] == 1
    op, _, hit_tokens = hit_query(ctl, tokens)
    assert hit_tokens == 0 and op.pool_storage_result.restorable_prefix_pages == [], "dropped: no usable prefix"
    backend.close()


def test_hybrid_share_and_unsupported_policy(tmp_path):
    """Each pool gets its share of the disk tier by host memory; a hit policy
    kvbm does not implement is refused by name."""
    group = pool_group()
    backend = attach_hybrid(storage_config(tmp_path, "page_first",
                                           extra={"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 1000}), group)
    pools = {n: group.get_pool(n) for n in (PoolName.KV, PoolName.MAMBA, PoolName.SWA)}
    total = sum(p.size * p.size_per_token for p in pools.values())
    for n, p in pools.items():
        assert backend.kvbm_info(n)["num_pages"] == int(1000 * p.size * p.size_per_token / total)
    tokens = list(range(PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    kv = pools[PoolName.KV]
    assert backend.batch_set_v1(keys, kv.alloc(PAGE)) == [True]
    with pytest.raises(ValueError, match="block_groups is not supported"):
        backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    backend.close()
