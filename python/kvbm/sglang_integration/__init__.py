"""kvbm as SGLang HiCache's storage backend (its L3).

SGLang's HiCache moves KV between GPU and host memory and hands host pages to
a pluggable ``HiCacheStorage``. :class:`KvbmHiCacheStorage` stores them in
kvbm's disk tier (G3): checksummed and MAC'd, and persistent across restarts
unless ``DYN_KVBM_DISK_PERSIST=false``; with ``DYN_KVBM_OBJECT_ENABLED`` also in
its shared object tier (G4), where every instance on the bucket finds them. Launch::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvbm",
        "module_path": "kvbm.sglang_integration", "class_name": "KvbmHiCacheStorage",
        "interface_v1": 1}'

The module imports SGLang only when the class is used (``import kvbm`` stays
light); see README "With SGLang".
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvbmHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvbmHiCacheStorage":
        from kvbm.sglang_integration.storage import KvbmHiCacheStorage

        return KvbmHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
