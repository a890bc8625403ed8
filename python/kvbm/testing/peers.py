"""The peer columns of bench/vllm_ttft.py: what a user would run instead of
kvbm, on the same prompts and the same memory.

* ``LMCache``: PyPI's ``lmcache`` in its multiprocess mode: vLLM's
  ``LMCacheMPConnector`` in the engine and an ``lmcache server`` process
  beside it (its in-process connector finds no CPU path on vLLM's CPU
  backend and silently recomputes). The server gets kvbm's G2 bytes as its
  L1 (host memory, LRU) and kvbm's G3 bytes as an L2 disk tier written and
  read with O_DIRECT, like kvbm's disk tier; it listens on 127.0.0.1 only,
  with its metrics and usage reporting off. It runs from its own
  environment (``scripts/lmcache-env.sh``: ``.venv-lmcache`` over ``.venv``'s
  packages), and so does that column's engine.
* ``vLLM OffloadingConnector``: vLLM's native CPU offloading with kvbm's G2
  bytes. vLLM refuses it on the CPU backend; the column then reports that
  start-up error as its result. On a GPU machine it runs like any column.

Nothing here starts a process: the functions build the command lines, the
connector configurations and the environments that kvbm.testing.compare runs.
"""

from __future__ import annotations

import json
import os
from typing import Any

LMCACHE = "LMCache"
OFFLOADING = "vLLM OffloadingConnector"
PEERS = (LMCACHE, OFFLOADING)

# LMCache's settings in its column besides the sizes (the configuration
# kvbm is compared with; see docs/benchmarks.md). L1 eviction must be named
# (the server refuses to start without one); skip_l1 stores every chunk to
# the disk tier and frees it from L1 (the L1 is then a write buffer and
# every re-visit beyond G1 is served from disk, as kvbm's G3 serves what has
# left G2); the disk tier evicts LRU once its bytes are used.
LMCACHE_STORE_POLICY = "skip_l1"
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false"}
# How KV moves between vLLM's cache and the server: "engine_driven", the
# engine's worker copying (what the connector's own "auto" picks on the CPU
# backend; 120 ms a re-visit against 166 ms for the other in the runs of
# docs/benchmarks.md, not the same run), or "lmcache_driven", the server reading and writing
# the engine's cache through shared memory. The server serves both
# (--supported-transfer-mode auto); its default serves only lmcache_driven,
# and the connector's auto request then hangs until its timeout.
LMCACHE_TRANSFER_MODE = "engine_driven"
GIB = 1 << 30


def lmcache_env_dir(root: str) -> str:
    """Where scripts/lmcache-env.sh puts LMCache's environment."""
    return os.environ.get("KVBM_LMCACHE_ENV") or os.path.join(root, ".venv-lmcache")


def lmcache_python(root: str) -> str | None:
    """The interpreter of LMCache's environment, or None when it is missing
    (scripts/lmcache-env.sh creates it)."""
    py = os.path.join(lmcache_env_dir(root), "bin", "python")
    return py if os.access(py, os.X_OK) else None


def block_bytes(model: dict, engine: dict) -> int:
    """Bytes of one vLLM KV block of the harness's model (K and V, every
    layer, block_size tokens): what kvbm's G2/G3 store per block, so the
    peers get the same bytes."""
    from kvbm.testing.compare import BS

    head_dim: int = model["hidden"] // model["heads"]
    layers: int = model["layers"]
    kv_heads: int = model["kv_heads"]
    dtype = engine.get("dtype") or model.get("dtype") or "float32"
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * layers * kv_heads * head_dim * BS * size


def lmcache_server_argv(env_dir: str, port: int, http_port: int, l1_bytes: int, disk_bytes: int,
                        disk_path: str, store_policy: str | None = None) -> list[str]:
    """``lmcache server`` with L1 = l1_bytes of host memory (LRU) and an
    O_DIRECT disk tier of disk_bytes under disk_path (LRU); store_policy
    (default LMCACHE_STORE_POLICY, read at the call): "skip_l1" or
    "default" (chunks stay in L1 too)."""
    store_policy = store_policy or LMCACHE_STORE_POLICY
    l2 = {"type": "fs_native", "base_path": disk_path, "use_odirect": True,
          "max_capacity_gb": disk_bytes / GIB, "eviction": {"eviction_policy": "LRU"}}
    return [os.path.join(env_dir, "bin", "lmcache"), "server",
            "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--disable-metrics",
            "--l1-size-gb", repr(l1_bytes / GIB),
            "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(l2, sort_keys=True),
            "--l2-store-policy", store_policy,
            # Both transfer paths served; the connector asks for
            # LMCACHE_TRANSFER_MODE (lmcache_transfer_config).
            "--supported-transfer-mode", "auto"]


def lmcache_transfer_config(port: int, transfer_mode: str | None = None) -> dict[str, Any]:
    """vLLM's LMCacheMPConnector pointed at the server on 127.0.0.1:port
    (transfer_mode: default LMCACHE_TRANSFER_MODE, read at the call)."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                          "lmcache.mp.mp_transfer_mode": transfer_mode or LMCACHE_TRANSFER_MODE,
                                          "lmcache.mp.mq_timeout": 60.0}}


def offloading_transfer_config(cpu_bytes: int) -> dict[str, Any]:
    """vLLM's native OffloadingConnector with cpu_bytes of host memory."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
