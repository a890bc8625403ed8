"""KVBM_CUDA_PACK_KV_CACHE: lay an engine's per-layer KV tensors out back to back.

vLLM allocates one KV tensor per layer. kvbm's CUDA copier moves a whole
block with one pitched copy (no kernel, the engine's kernels barely slowed;
docs/cuda.md) only where the layers' tensors are equally spaced in
ascending order, and the CUDA caching allocator did not lay successive
large allocations out that way on an H200 (bench/gpu_transfer.py prints how
they lie). vLLM asks its KV connector for an
allocation context before it allocates the KV cache
(``KVConnectorBase_V1.get_mem_pool_context``); with this variable set, kvbm
answers with a private memory pool whose segments are expandable, so the
layers' tensors are mapped one after the other, ascending and equally
spaced. Off by default (a kvbm extension, not a Dynamo variable).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from kvbm._envs import env_bool

log = logging.getLogger("kvbm")

ENV = "KVBM_CUDA_PACK_KV_CACHE"

# Pools handed out; each must outlive the tensors allocated from it.
_pools: list[Any] = []


def enabled() -> bool:
    return env_bool(ENV, False)


def _expandable_already() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _set_expandable(torch: Any, on: bool) -> None:
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


@contextlib.contextmanager
def packed_kv_allocations() -> Iterator[None]:
    """Allocations made inside land in one private pool of expandable
    segments: successive tensors back to back, ascending. Without CUDA it
    does nothing."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    pool = torch.cuda.MemPool()
    _pools.append(pool)
    toggle = not _expandable_already()
    if toggle:
        _set_expandable(torch, True)
    try:
        with torch.cuda.use_mem_pool(pool):
            yield
    finally:
        if toggle:
            _set_expandable(torch, False)
    log.info("kvbm: KV cache allocated in a packed pool (%s): layers back to back", ENV)


def mem_pool_context() -> contextlib.AbstractContextManager[None] | None:
    """What a worker-side connector answers to ``get_mem_pool_context``:
    the packed pool when KVBM_CUDA_PACK_KV_CACHE is set, else None (the
    engine's own allocation)."""
    if not enabled():
        return None
    return packed_kv_allocations()
