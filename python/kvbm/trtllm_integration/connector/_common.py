"""What the TensorRT-LLM leader and worker share: the engine's base classes
(or plain stand-ins), reading ``llm_args``, the settings kvbm refuses, and the
process-local link between the rank-0 worker and the leader.

Nothing here loads the native library.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from kvbm import _model_digest

# A child of TensorRT-LLM's logger name, so lines are easy to find in its log.
log = logging.getLogger("tensorrt_llm.kvbm")

# The engine's base classes: 1.2.x has them in pyexecutor.kv_cache_connector,
# newer releases in pyexecutor.connectors.kv_cache_connector. Without
# TensorRT-LLM (configuration tooling, our tests) the classes still import,
# over plain bases with the same constructor and metadata helpers.
_BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
)


def _import_bases() -> tuple[Any, Any, str | None]:
    import importlib

    for name in _BASE_MODULES:
        try:
            mod = importlib.import_module(name)
            return mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker, name
        except Exception:  # noqa: BLE001 - absent, or present but not importable here
            continue
    return None, None, None


KvCacheConnectorScheduler, KvCacheConnectorWorker, BASE_MODULE = _import_bases()
HAVE_TRTLLM = BASE_MODULE is not None

if not HAVE_TRTLLM:

    class KvCacheConnectorScheduler:  # type: ignore[no-redef]  # stand-in under the engine's name
        """Stand-in for TensorRT-LLM's scheduler-side base class."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args

    class KvCacheConnectorWorker:  # type: ignore[no-redef]  # stand-in under the engine's name
        """Stand-in for TensorRT-LLM's worker-side base class."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args
            self._metadata: Any = None

        def bind_connector_meta(self, metadata: Any) -> None:
            self._metadata = metadata

        def get_connector_meta(self) -> Any:
            return self._metadata

        def _clear_connector_meta(self) -> None:
            self._metadata = None

        def register_forward_pass_callable(self) -> Any:
            return None


# TensorRT-LLM's default retention priority (KvCacheRetentionConfig, 0..100):
# what a block has when the request carries no retention config.
DEFAULT_PRIORITY = 35
DEFAULT_TOKENS_PER_BLOCK = 32


# ----------------------------------------------------------------- llm_args


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    """First attribute (or dict key) of obj among names that is not None."""
    for n in names:
        if obj is None:
            return default
        v = obj.get(n) if isinstance(obj, dict) else getattr(obj, n, None)
        if v is not None:
            return v
    return default


def kv_cache_config(llm_args: Any) -> Any:
    return _get(llm_args, "kv_cache_config")


def tokens_per_block(llm_args: Any) -> int:
    bs = _get(kv_cache_config(llm_args), "tokens_per_block", default=DEFAULT_TOKENS_PER_BLOCK)
    bs = int(bs)
    if bs < 1:
        raise ValueError(f"kvbm: kv_cache_config.tokens_per_block={bs}: must be positive")
    return bs


def _mapping(llm_args: Any) -> Any:
    pc = _get(llm_args, "parallel_config")
    to_mapping = getattr(pc, "to_mapping", None)
    if callable(to_mapping):
        try:
            return to_mapping()
        except Exception:  # noqa: BLE001 - fall back to the plain fields
            return None
    return None


def parallel_sizes(llm_args: Any) -> dict[str, int]:
    """tp, pp, cp sizes from llm_args (TorchLlmArgs fields, parallel_config, or its mapping)."""
    pc = _get(llm_args, "parallel_config")
    m = _mapping(llm_args)
    return {
        "tp": int(_get(llm_args, "tensor_parallel_size", default=None)
                  or _get(pc, "tp_size", default=None) or _get(m, "tp_size", default=1)),
        "pp": int(_get(llm_args, "pipeline_parallel_size", default=None)
                  or _get(pc, "pp_size", default=None) or _get(m, "pp_size", default=1)),
        "cp": int(_get(llm_args, "context_parallel_size", default=None)
                  or _get(pc, "cp_size", default=None) or _get(m, "cp_size", default=1)),
    }


def model_identity(llm_args: Any) -> str:
    """The model's name or path, revision when set and files digest
    (kvbm._model_digest): blocks kept beyond this process (persistent disk
    tier, object storage) only match the same weights."""
    model = _get(llm_args, "model")
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    return _model_digest.model_identity(model if isinstance(model, str) else "", _get(llm_args, "revision"))


def this_rank(llm_args: Any) -> int:
    """This process's rank: TensorRT-LLM's MPI rank when available, else the
    mapping's rank, else the usual launcher variables, else 0."""
    try:
        from tensorrt_llm._utils import mpi_rank

        return int(mpi_rank())
    except Exception:  # noqa: BLE001
        pass
    m = _mapping(llm_args)
    if m is not None and getattr(m, "rank", None) is not None:
        return int(m.rank)
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 0


def _policy_name(policy: Any) -> str:
    name = getattr(policy, "name", None) or str(policy)
    return name.rsplit(".", 1)[-1].upper()


# Why several attention window sizes (variable sliding-window attention) are
# refused, from TensorRT-LLM's connector contract (docs/design.md §11).
VSWA_MISSING = (
    "several attention window sizes: TensorRT-LLM's V1 KV cache manager, whose primary pool kvbm moves, "
    "keeps one pool per window size and hands a connector one pool (get_unique_primary_pool), so it refuses "
    "a KV cache connector with several (\"KV Cache Connector is not supported with multiple window sizes\"); "
    "per-window pools reach a connector only from KVCacheManagerV2, through register_kv_cache_layout and "
    "update_state_after_alloc_by_layer_group / request_finished_by_layer_group (TensorRT-LLM main, not 1.2), "
    "which kvbm does not implement; serve the model with one window size")


def check_supported(llm_args: Any) -> None:
    """Refuse settings kvbm cannot serve correctly, naming the setting.

    TensorRT-LLM itself refuses some of these with a connector (pipeline
    parallelism, a capacity policy other than GUARANTEED_NO_EVICT); newer
    releases refuse the rest (#13577). Checking here gives the same answer on
    every version, before any KV is moved.
    """
    problems: list[str] = []
    sizes = parallel_sizes(llm_args)
    if sizes["pp"] > 1:
        problems.append(f"pipeline_parallel_size={sizes['pp']} (pipeline parallelism; use tensor parallelism)")
    if sizes["cp"] > 1:
        problems.append(f"context_parallel_size={sizes['cp']} (context parallelism)")
    beam = _get(llm_args, "max_beam_width", default=1)
    if int(beam) > 1:
        problems.append(f"max_beam_width={beam} (beam search: the connector only sees beam 0's blocks)")
    kvc = kv_cache_config(llm_args)
    host = _get(kvc, "host_cache_size", default=0)
    if host and int(host) > 0:
        problems.append(f"kv_cache_config.host_cache_size={host} (TensorRT-LLM's own host offload moves blocks "
                        "behind the connector's back; kvbm is the host tier: leave it unset)")
    sched = _get(llm_args, "scheduler_config")
    policy = _get(sched, "capacity_scheduler_policy")
    if policy is not None and _policy_name(policy) != "GUARANTEED_NO_EVICT":
        problems.append(f"scheduler_config.capacity_scheduler_policy={_policy_name(policy)} "
                        "(must be GUARANTEED_NO_EVICT)")
    if _get(llm_args, "enable_attention_dp", default=False) is True:
        problems.append("enable_attention_dp=True (attention data parallelism)")
    v2 = _get(kvc, "use_kv_cache_manager_v2")
    if v2 is True or str(v2).lower() == "true":
        problems.append("kv_cache_config.use_kv_cache_manager_v2=True (kvbm moves blocks of the V1 manager's "
                        "primary pool; KVCacheManagerV2 pages and partially cancelled loads are not supported: "
                        "set it to false)")
    windows = _get(kvc, "max_attention_window")
    if isinstance(windows, (list, tuple)) and len(set(windows)) > 1:
        problems.append(f"kv_cache_config.max_attention_window={list(windows)} ({VSWA_MISSING})")
    if problems:
        raise ValueError("kvbm TensorRT-LLM connector: unsupported setting(s): " + "; ".join(problems))
    if isinstance(v2, str) and v2.lower() == "auto":
        log.warning("kvbm: kv_cache_config.use_kv_cache_manager_v2=auto; kvbm needs the V1 KV cache manager and "
                    "turns itself off if TensorRT-LLM picks KVCacheManagerV2. Set it to false.")
    if _get(kvc, "enable_block_reuse", default=True) is False:
        log.warning("kvbm: kv_cache_config.enable_block_reuse=False: TensorRT-LLM then never asks the connector "
                    "for matches, so kvbm only offloads and never onboards. Set it to true.")
    if _get(kvc, "enable_partial_reuse", default=True) is not False:
        log.info("kvbm: kv_cache_config.enable_partial_reuse is on; a partial device hit makes the computed "
                 "prefix unaligned and kvbm then loads nothing for that request. enable_partial_reuse: false "
                 "gives more kvbm hits.")


# ---------------------------------------------------------- bytes per block

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "int8": 1, "nvfp4": 1, "fp4": 1,
}


def bytes_per_block_from_model(llm_args: Any, tp: int) -> int | None:
    """One rank's bytes per block from the model's config.json, when
    ``llm_args.model`` is a local checkpoint directory; None otherwise.

    num_layers × 2 × tokens_per_block × kv_heads_per_rank × head_dim × dtype
    bytes (design §2). kv_heads_per_rank is kv_heads / tp, at least 1 (heads are
    replicated when tp exceeds them).
    """
    model = _get(llm_args, "model")
    if not isinstance(model, (str, os.PathLike)):
        return None
    path = os.path.join(os.fspath(model), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    layers = cfg.get("num_hidden_layers")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    dt = str(_get(kv_cache_config(llm_args), "dtype", default="auto") or "auto").lower()
    if dt == "auto":
        dt = str(_get(llm_args, "dtype", default="auto") or "auto").lower()
    if dt == "auto":
        dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    db = _DTYPE_BYTES.get(dt.replace("torch.", ""))
    if db is None:
        return None
    per_rank_heads = max(1, int(kv_heads) // max(1, tp))
    return int(layers) * 2 * tokens_per_block(llm_args) * per_rank_heads * int(head_dim) * db


def _env_num(name: str) -> float:
    try:
        return float(os.environ.get(name, "") or 0)
    except ValueError:
        return 0.0


def tiers_sized_by_block_count() -> bool:
    """True when every configured tier is sized by an explicit block count, so
    the leader's sizing does not depend on bytes per block."""
    ok = False
    for gb, override in (("DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"),
                         ("DYN_KVBM_DISK_CACHE_GB", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS")):
        if _env_num(override) > 0:
            ok = True
        elif _env_num(gb) > 0:
            return False
    return ok


# ------------------------------------------- rank 0: worker → leader, in-process


class LocalLink:
    """What the worker reports to a leader living in the same process.

    TensorRT-LLM creates the scheduler only on rank 0, in the same process as
    rank 0's worker, and calls register_kv_caches before it schedules anything.
    So the leader can learn the exact bytes per block from the worker there,
    rank 0's G4 block fingerprint, what the persistent disk tier of each rank
    in this process recovered (the leader registers it when every rank's is
    here), and rank 0's failed block loads (TensorRT-LLM has no engine path
    that carries load errors from workers to the scheduler).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_per_block: int | None = None
        self.worker_failed: str | None = None
        self.fingerprint = ""  # rank 0's, with a G4 tier
        self.recovered: dict[int, bytes] = {}  # rank -> kvbm._core.Worker.recovered()
        self._load_errors: list[int] = []

    def worker_ready(self, bytes_per_block: int, rank: int = 0, fingerprint: str = "",
                     recovered: bytes = b"") -> None:
        with self._lock:
            self.bytes_per_block = int(bytes_per_block)
            if rank == 0 and fingerprint:
                self.fingerprint = fingerprint
            if recovered:
                self.recovered[rank] = recovered

    def take_recovered(self, num_ranks: int) -> list[bytes] | None:
        """Every rank's recovered index, rank 0 first, when all num_ranks
        are here (then forgotten); None otherwise."""
        with self._lock:
            if any(r not in self.recovered for r in range(num_ranks)):
                return None
            out = [self.recovered.pop(r) for r in range(num_ranks)]
            return out

    def worker_down(self, reason: str) -> None:
        with self._lock:
            self.worker_failed = reason

    def add_load_errors(self, g1_blocks: Iterable[int]) -> None:
        with self._lock:
            self._load_errors.extend(int(b) for b in g1_blocks)

    def take_load_errors(self) -> list[int]:
        with self._lock:
            errs, self._load_errors = self._load_errors, []
            return errs

    def reset(self) -> None:
        with self._lock:
            self.bytes_per_block = None
            self.worker_failed = None
            self.fingerprint = ""
            self.recovered = {}
            self._load_errors = []


LOCAL = LocalLink()
