"""``DynamoConnector``: vLLM's KV connector v1 interface over kvbm's Go leader
and worker.

vLLM creates one connector per role: the scheduler-side instance (role
SCHEDULER, in vLLM's EngineCore process) delegates to
:class:`~kvbm.vllm_integration.connector.vllm_leader.VllmConnectorLeader`,
which owns a :class:`kvbm._core.Leader`; each worker-side instance (role
WORKER, one per tensor-parallel rank) delegates to
:class:`~kvbm.vllm_integration.connector.vllm_worker.VllmConnectorWorker`,
which owns a :class:`kvbm._core.Worker`. The adapter only turns vLLM objects
into plain lists and back: matching, offload planning and byte movement
happen in Go. A call meant for the other role gets the answer vLLM's base
class would give.

Per engine step:

* scheduler: ``build_connector_meta`` sends what was scheduled to the leader
  and ships the returned plan (bytes) in :class:`DynamoConnectorMetadata`;
* worker: ``bind_connector_metadata`` hands the plan to the worker,
  ``start_load_kv`` starts its loads (G2/G3 → G1, asynchronous),
  ``wait_for_save`` runs its offloads (G1 → G2, G2 → G3) once the forward pass
  has written the step's KV, and ``get_finished`` reports finished loads;
* load failures (a G3 block whose checksum does not verify, an I/O error) are
  reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them.

A load promised to vLLM (``update_state_after_alloc`` with external tokens)
keeps the request waiting until the workers report it finished. If kvbm fails
before that load is in a plan, the next metadata names it in ``failed_loads``
and the workers report it finished, with every block failed, from the
``get_finished`` of that step; loads already in a bound plan are the workers'
own.

With vLLM's hybrid KV cache manager (kvbm declares ``SupportsHMA``), models
whose KV cache groups mix full attention with sliding-window or chunked local
attention are served per group (``_groups.py``, docs/design.md §11).

Anything kvbm cannot handle (multimodal prompts, KV cache groups of Mamba or
other state layers, several groups on device tensors, device tensors without
the CUDA build) is bypassed with a log line: the engine keeps serving, those
requests just get no external hits and their KV is not offloaded (a multimodal prompt's token ids do not identify
its KV, so storing it under them could serve it to another prompt).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from kvbm import _kvpool
# vLLM's base classes (or stand-ins), the metadata types and the helpers that
# read vLLM's configuration, importable from this module as well.
from kvbm.vllm_integration.connector._common import (
    _HAVE_VLLM,
    DynamoConnectorMetadata,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    KvbmRecoveredMetadata,
    SupportsHMA,
    VllmSide,
    _bypassed,
    _lora_name,
    _model_identity,
    _role_name,
    _tp,
    log,
)
from kvbm._record import VLLM_SCHEDULER_METHODS, record_calls
from kvbm.vllm_integration.connector._stats import KvbmConnectorStats, KvbmPromMetrics
from kvbm.vllm_integration.connector.vllm_leader import VllmConnectorLeader
from kvbm.vllm_integration.connector.vllm_worker import VllmConnectorWorker

if KVConnectorWorkerMetadata is not None:
    from kvbm.vllm_integration.connector._common import KvbmWorkerMeta

if TYPE_CHECKING:
    from kvbm._core import Leader, Worker
    from kvbm.vllm_integration.connector._common import KvbmWorkerMeta  # noqa: F811

__all__ = [
    "DynamoConnector",
    "DynamoConnectorMetadata",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "KvbmRecoveredMetadata",
    "VllmConnectorLeader",
    "VllmConnectorWorker",
    "log",
]
if KVConnectorWorkerMetadata is not None:
    __all__.append("KvbmWorkerMeta")


class DynamoConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbm as a vLLM KV connector (both roles). It supports vLLM's hybrid
    KV cache manager (SupportsHMA): with it on, models with several KV
    cache groups keep them (_groups.py); a model with groups kvbm cannot
    serve yet runs without kvbm, served by vLLM."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM < 0.12: no kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._is_scheduler = _role_name(role).endswith("SCHEDULER")
        self._scheduler_side: VllmConnectorLeader | None = None
        self._worker_side: VllmConnectorWorker | None = None
        if self._is_scheduler:
            self._scheduler_side = VllmConnectorLeader(vllm_config, kv_cache_config)
            record_calls(self, "vllm", VLLM_SCHEDULER_METHODS)  # DYN_KVBM_ENABLE_RECORD
        else:
            # Its kvbm worker is created in register_kv_caches, once the tensors exist.
            self._worker_side = VllmConnectorWorker(vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ common

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future miss: vLLM need not wait for delivery.
        return False

    @property
    def _side(self) -> VllmSide:
        side: VllmSide | None = self._scheduler_side if self._is_scheduler else self._worker_side
        assert side is not None
        return side

    @property
    def _leader(self) -> Leader | None:
        """The scheduler side's kvbm leader (None on a worker, or when kvbm is off)."""
        return self._scheduler_side._leader if self._scheduler_side is not None else None

    @property
    def _worker(self) -> Worker | None:
        """The worker side's kvbm worker (None on the scheduler, before
        register_kv_caches, or when kvbm is off)."""
        return self._worker_side._worker if self._worker_side is not None else None

    @property
    def _failed(self) -> str | None:
        """Where and why kvbm failed on this side (None while healthy)."""
        return self._side._failed

    @property
    def _disabled_reason(self) -> str | None:
        """Why kvbm is off for this engine (None when it runs)."""
        return self._side._disabled_reason

    def shutdown(self) -> None:
        if self._scheduler_side is not None:
            self._scheduler_side.shutdown()
        if self._worker_side is not None:
            self._worker_side.shutdown()

    # --------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler_side is None:
            return 0, False
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler_side is not None:
            self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        if self._scheduler_side is None:
            return {}
        return self._scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> DynamoConnectorMetadata:
        if self._scheduler_side is None:
            return DynamoConnectorMetadata()
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler_side is not None:
            self._scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler_side is None:
            return False, None
        return self._scheduler_side.request_finished(request, block_ids)

    def take_events(self) -> list[Any]:
        """Scheduler: kvbm's host (G2) and disk (G3) stores and removals
        since the last step as vLLM events (medium CPU / STORAGE), under
        vLLM's block hashes, when vLLM publishes KV events."""
        if self._scheduler_side is None:
            return []
        return self._scheduler_side.take_events()

    def get_kv_connector_stats(self) -> KvbmConnectorStats | None:
        """Both roles, every step: this side's figures since the last call
        (workers: transfers and load errors; scheduler: lookups, hits and
        loads per tier, the leader's gauges). vLLM aggregates the ranks' and
        the scheduler's and shows them in its log line and on /metrics."""
        if self._scheduler_side is not None:
            return self._scheduler_side.get_kv_connector_stats()
        if self._worker_side is not None:
            return self._worker_side.get_kv_connector_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvbmConnectorStats:
        # A copy: vLLM hands the same payload to its log and Prometheus
        # loggers, and the log's accumulator aggregates into this object.
        return KvbmConnectorStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvbmPromMetrics:
        """kvbm's series on vLLM's /metrics (vllm:kvbm_*)."""
        return KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        if self._scheduler_side is None:
            return True
        return self._scheduler_side.reset_cache()

    def get_finished_count(self) -> int | None:
        return None

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Scheduler: vLLM hands over what every worker's
        get_handshake_metadata returned (tp rank → metadata) once the KV
        caches are registered, before the first step: register the disk
        tier blocks every rank's persistent tier recovered."""
        if self._scheduler_side is not None:
            self._scheduler_side.set_xfer_handshake_metadata(metadata)

    # ------------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker_side is not None:
            self._worker_side.register_kv_caches(kv_caches)

    # Sleep mode (vLLM >= 0.33: llm.sleep() / wake_up()). The KV cache memory
    # is released and mapped again, its contents discarded; kvbm's Go worker
    # holds the tensors' addresses (and, in the CUDA build, device state for
    # them) from register_kv_caches and has no way to let go of them while
    # keeping its host and disk tiers. So kvbm declines sleep mode, and vLLM
    # refuses the configuration at start instead of serving from stale
    # addresses.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        log.warning("kvbm: DynamoConnector does not support vLLM's sleep mode (its KV cache remap would leave "
                    "kvbm's worker with stale KV cache addresses); run without --enable-sleep-mode to use kvbm")
        return False

    def unregister_kv_caches(self) -> None:
        """Worker, before the KV cache memory goes (sleep mode, reached
        only if supports_sleep_mode was not asked): kvbm stops touching it
        and stays off for this engine; promised loads are reported failed."""
        if self._worker_side is not None:
            self._worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """Worker, after wake-up: kvbm stays off (see unregister_kv_caches)."""
        if self._worker_side is not None:
            self._worker_side.restore_kv_caches()

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        """Worker: the allocation context vLLM allocates the KV cache in
        (KVBM_CUDA_PACK_KV_CACHE, kvbm/_kvpool.py), or None for its own."""
        if self._worker_side is None:
            return None
        return _kvpool.mem_pool_context()

    def get_handshake_metadata(self) -> KvbmRecoveredMetadata | None:
        """Worker: this rank's recovered persistent disk tier index (None
        without one), which vLLM passes to the scheduler's connector."""
        if self._worker_side is None:
            return None
        return self._worker_side.get_handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker_side is not None:
            self._worker_side.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker_side is not None:
            self._worker_side.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Saves run in wait_for_save, once the whole step has been written: layer
        # hooks are skipped under full CUDA graphs and on steps without attention.
        return None

    def wait_for_save(self) -> None:
        if self._worker_side is not None:
            self._worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker_side is None:
            return None, None
        return self._worker_side.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KvbmWorkerMeta | None:
        if self._worker_side is None:
            return None
        return self._worker_side.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker_side is None:
            return set()
        return self._worker_side.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker: vLLM's base answer (get_finished), plus the requests whose
        load failed with several KV cache groups, where vLLM takes failures
        per request (failed_recving), not per block."""
        results = super().get_transfer_results(finished_req_ids)
        if self._worker_side is not None and hasattr(results, "failed_recving"):
            failed = self._worker_side.take_failed_recving()
            results.failed_recving |= failed
            results.finished_recving |= failed
        return results

    # ------------------------------------------------------------ hybrid (HMA)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: the request finished for every
        KV cache group. kvbm's saves ran in the steps that computed the
        blocks, so it never holds them past this call. Goes through
        request_finished (what DYN_KVBM_ENABLE_RECORD records), with one
        group's list as vLLM passes it without the hybrid manager."""
        ids = block_ids[0] if isinstance(block_ids, tuple) and len(block_ids) == 1 else block_ids
        return self.request_finished(request, ids)
