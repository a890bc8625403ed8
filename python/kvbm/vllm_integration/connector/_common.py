"""What the vLLM leader and worker share: vLLM's connector base classes (or
plain stand-ins without vLLM), the metadata types that cross between them,
reading vLLM's configuration, and the failure state of each side.

Nothing here loads the native library.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvbm._adapter_common import FailureState
from kvbm._model_digest import model_identity

# A child of vLLM's logger, so lines appear in the engine's own log format.
log = logging.getLogger("vllm.kvbm")

try:  # vLLM is optional at import time (config tooling, unit tests).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    _HAVE_VLLM = True
except Exception:  # pragma: no cover - exercised only without vLLM
    _HAVE_VLLM = False

    class KVConnectorMetadata:  # type: ignore[no-redef]  # stand-in under vLLM's name
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]  # stand-in under vLLM's name
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    class KVConnectorRole:  # type: ignore[no-redef]  # stand-in under vLLM's name
        SCHEDULER = 0
        WORKER = 1

try:  # vLLM's hybrid KV cache manager stays on only for connectors that declare it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except Exception:  # pragma: no cover - older vLLM or none

    class SupportsHMA:  # type: ignore[no-redef]  # stand-in under vLLM's name
        pass


try:  # worker → scheduler metadata (vLLM ≥ 0.32); without it G4 matching waits for nothing
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except Exception:  # pragma: no cover - older vLLM or none
    KVConnectorWorkerMetadata = None


if KVConnectorWorkerMetadata is not None:

    @dataclass
    class KvbmWorkerMeta(KVConnectorWorkerMetadata):
        """What workers tell the scheduler-side leader each step (vLLM may run
        them in other processes): each rank's G4 report (blocks it stored,
        its counters), rank 0's timed load batches (the leader's load-cost
        model), and, with several KV cache groups, the G1 blocks whose load
        failed (vLLM takes those failures per request, so the leader learns
        the blocks here, to drop their sources)."""

        g4_reports: list[bytes] = field(default_factory=list)
        load_errors: list[int] = field(default_factory=list)
        # Rank 0's timed load batches, for the leader's load-cost model.
        transfer_timings: list[bytes] = field(default_factory=list)

        def aggregate(self, other: KvbmWorkerMeta) -> KvbmWorkerMeta:
            return KvbmWorkerMeta(g4_reports=self.g4_reports + other.g4_reports,
                                  load_errors=self.load_errors + other.load_errors,
                                  transfer_timings=self.transfer_timings + other.transfer_timings)


try:  # vLLM versions with worker → scheduler handshake metadata
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except Exception:  # pragma: no cover - older vLLM or none

    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]  # stand-in under vLLM's name
        pass


@dataclass
class KvbmRecoveredMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler's leader once, after registering its
    KV caches and before the first step, whether vLLM runs it in the
    scheduler's process or another: its persistent disk tier index,
    recovered at start (kvbm._core.Worker.recovered), and, on rank 0 with a
    G4 tier, its block fingerprint, which names its G4 objects (the leader
    looks G4 blocks up under it)."""

    recovered: bytes = b""
    g4_fingerprint: str = ""


@dataclass
class DynamoConnectorMetadata(KVConnectorMetadata):
    """One step's plan for the workers (opaque bytes from the Go leader)."""

    plan: bytes = b""
    seq: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Loads promised to vLLM that no plan will carry (kvbm failed first):
    # request id → the G1 blocks vLLM expects loaded, to report as failed.
    failed_loads: dict[str, list[int]] = field(default_factory=dict)


def _role_name(role: Any) -> str:
    return str(getattr(role, "name", str(role))).upper()


def _lora_name(request: Any) -> str | None:
    lr = getattr(request, "lora_request", None)
    name = getattr(lr, "lora_name", None) if lr is not None else None
    return None if name is None else str(name)


def _model_identity(vllm_config: Any) -> str:
    """The model's name or path, revision and files digest
    (kvbm._model_digest): blocks kept beyond this process (persistent disk
    tier, object storage) only match the same weights."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return ""
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    return model_identity(str(getattr(mc, "model", "") or ""), getattr(mc, "revision", None),
                          download_dir if isinstance(download_dir, str) and download_dir else None)


def _tp(vllm_config: Any) -> tuple[int, int]:
    """(rank, size) of this tensor-parallel group; (0, 1) outside vLLM's groups."""
    size = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    rank = 0
    if size > 1:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:
            rank = int(os.environ.get("RANK", "0"))
    return rank, size


def _bypassed(request: Any) -> bool:
    """Token ids do not identify the KV of multimodal prompts (placeholder
    ids stand for the images) or of prompt embeddings: kvbm neither serves
    nor stores it."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


def _side_channel_secret(vllm_config: Any) -> str:
    # The engine instance's id: vLLM draws it at random (uuid4) when the
    # configuration is created and ships the same configuration to the
    # scheduler and every worker, and no peer outside the engine sees it.
    # It authenticates the leader/worker side channel (goext/wire/auth.go);
    # DYN_KVBM_LEADER_WORKER_SECRET, when set, is used instead.
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = getattr(ktc, "engine_id", None)
    return f"vllm-engine:{engine_id}" if engine_id else ""


class VllmSide(FailureState):
    """State both sides keep: the failure state :func:`kvbm._adapter_common.guarded`
    reads, and the reason kvbm is off for the engine (an unsupported model),
    which, unlike a failure, is known at start."""

    _log = log
    _engine_name = "vLLM"

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._disabled_reason: str | None = None

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        log.error("kvbm disabled for this engine: %s. vLLM keeps serving without kvbm's cache tiers.", reason)
