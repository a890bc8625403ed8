"""``DynamoKVBMConnectorWorker``: TensorRT-LLM's worker-side connector (every
rank) over :class:`kvbm._core.Worker`.

Per iteration TensorRT-LLM calls, on every rank: ``bind_connector_meta``
(the leader's plan, the same bytes on every rank), ``start_load_kv``, the
per-layer hooks around each decoder layer, ``wait_for_save`` after the
forward pass, and ``get_finished`` once at the end of the iteration (also on
iterations that forward nothing).

What runs where:

* loads (G2/G3 → G1) start in ``start_load_kv`` and run in the background.
  A request whose prefix is loading is out of the batch until every rank
  reported it from ``get_finished``, so no layer reads its blocks meanwhile:
  ``wait_for_layer_load`` has nothing to wait for;
* offloads (G1 → G2, G2 → G3) run inside ``wait_for_save``, once the whole
  forward pass has written the step's KV. ``save_kv_layer`` does nothing: the
  layer hooks do not run on CUDA-graph replays, so correctness never depends
  on them.

Each rank holds its own shard (its KV heads) of every G1, G2 and G3 block and
executes the same plan on it; G2/G3 are sized by every rank from the same
environment, so block ids agree without a side channel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvbm import _native
from kvbm._adapter_common import FailureState, guarded, plan_loads
from kvbm.trtllm_integration.connector._common import (
    LOCAL,
    KvCacheConnectorWorker,
    check_supported,
    log,
    parallel_sizes,
    model_identity,
    this_rank,
    tokens_per_block,
)

if TYPE_CHECKING:
    from kvbm._core import Worker

# An id TensorRT-LLM announced as loading but that no bound plan carries (the
# leader failed between matching and planning, or planned fewer blocks) is
# reported finished after this many get_finished calls, so the request does not
# wait forever.
_ORPHAN_LOAD_GRACE = 2


class DynamoKVBMConnectorWorker(FailureState, KvCacheConnectorWorker):
    """kvbm's TensorRT-LLM worker connector (one per rank)."""

    _log = log
    _engine_name = "TensorRT-LLM"

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        check_supported(llm_args)
        self._block_size = tokens_per_block(llm_args)
        self._tp = parallel_sizes(llm_args)["tp"]
        self._rank = this_rank(llm_args)
        self._model = model_identity(llm_args)
        self._worker: Worker | None = None
        self._kv: Any = None  # the engine's torch tensor
        self._cuda = False
        self._fwd_event: Any = None  # CUDA event recorded at the end of the forward pass
        self._fwd_recorded = False  # ... during the current step
        self._failed: str | None = None
        self._disabled_reason: str | None = None
        # Loads: request id (int) → G1 blocks, from bound plans, until this
        # rank's copies finished; ids this rank finished; ids TensorRT-LLM
        # announced (started_loading_req_ids). A load is reported once it is
        # both announced and finished here, exactly once.
        self._inflight: dict[int, list[int]] = {}
        self._done: set[int] = set()
        self._announced: dict[int, int] = {}  # id → get_finished calls since announced
        # Whether the bound step's start_load / wait_for_save have work
        # (the worker's bind says so); a call without work is not made.
        self._start_due = False
        self._save_due = False

    # ------------------------------------------------------------ lifecycle

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        LOCAL.worker_down(reason)
        log.error("kvbm disabled on rank %d: %s. TensorRT-LLM keeps serving without kvbm's cache tiers.",
                  self._rank, reason)

    def _fail(self, where: str, err: Exception) -> None:
        LOCAL.worker_down(f"{where}: {err}")
        super()._fail(where, err)

    @guarded(None)
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """The primary pool: one tensor [num_blocks, num_layers, kv_factor,
        kv_heads × tokens_per_block × head_dim] (layout kind "trtllm")."""
        from kvbm._core import Worker

        t = kv_cache_tensor
        if t.dim() != 4:
            self._disable(f"KV cache tensor has shape {tuple(t.shape)}; expected TensorRT-LLM's primary pool "
                          "[num_blocks, num_layers, 2, kv_heads*tokens_per_block*head_dim]")
            return
        if t.device.type != "cpu" and not _native.has_cuda():
            self._disable(f"the KV cache is on {t.device} but the loaded kvbm library ({_native.loaded_path()}) "
                          f"is the {_native.build_info()['variant']} build, without CUDA support "
                          "(build it with `make cuda`)")
            return
        self._cuda = t.device.type == "cuda"
        self._kv = t  # keep the engine's tensor alive as long as Go holds its address
        self._worker = Worker(
            tensors=[(t.data_ptr(), list(t.shape), list(t.stride()))], kind="trtllm",
            num_blocks=int(t.shape[0]), block_size=self._block_size, dtype_bytes=t.element_size(),
            rank=self._rank, num_workers=self._tp, model=self._model, dtype=str(t.dtype),
        )
        info = self._worker.info()
        # The leader of this process (rank 0's) learns what it needs of the
        # workers here: no other route reaches it.
        LOCAL.worker_ready(info["bytes_per_block"], self._rank, info["fingerprint"] if info.get("g4") else "",
                           self._worker.recovered() if info.get("disk_persistent") else b"")
        log.info("kvbm worker ready (pid %d, rank %d/%d): %d blocks of %d bytes, %d layers, host_blocks=%d "
                 "disk_blocks=%d", os.getpid(), self._rank, self._tp, t.shape[0], info["bytes_per_block"],
                 info["num_layers"], info["host_blocks"], info["disk_blocks"])

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Newer TensorRT-LLM calls this instead of register_kv_caches with
        KVCacheManagerV2 (pools and pages per layer group, loads the runtime
        may cancel in part): not kvbm's model of the cache, so kvbm turns
        itself off, and the leader in this process with it."""
        self._disable("TensorRT-LLM's KVCacheManagerV2 is in use (register_kv_cache_layout); kvbm supports the V1 "
                      "KV cache manager: set kv_cache_config.use_kv_cache_manager_v2 to false")

    def shutdown(self) -> None:
        if self._worker is not None:
            try:
                self._worker.close()
            except Exception:  # pragma: no cover
                log.exception("kvbm: error while shutting down the worker")
            self._worker = None

    # --------------------------------------------------------------- per step

    def bind_connector_meta(self, metadata: Any) -> None:
        super().bind_connector_meta(metadata)
        plan = metadata if isinstance(metadata, (bytes, bytearray)) else b""
        if not plan or self._failed is not None:
            return
        try:
            if self._worker is not None:
                # Go decodes the plan; bind answers with this rank's loads.
                bound = self._worker.bind(bytes(plan))
                loads = bound.loads
                self._start_due = self._start_due or bound.start
                self._save_due = self._save_due or bound.save
            else:
                loads = plan_loads(bytes(plan))
            for rid, blocks in loads.items():
                self._inflight[int(rid)] = blocks
        except Exception as e:  # noqa: BLE001 - the engine must survive
            try:
                for rid, blocks in plan_loads(bytes(plan)).items():
                    self._inflight[int(rid)] = blocks
            except Exception:  # noqa: BLE001 - a plan that does not decode names no load
                pass
            self._fail("bind_connector_meta", e)

    @guarded(None)
    def start_load_kv(self, stream: Any = None) -> None:
        if self._worker is not None and self._start_due:
            self._start_due = False
            self._worker.start_load()

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        # Loading requests are out of the batch until get_finished reports
        # them on every rank: no layer of this forward pass reads their blocks.
        return None

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        # Saves run in wait_for_save, after the last layer: these hooks do not
        # run on CUDA-graph replays.
        return None

    def register_forward_pass_callable(self) -> Callable[[], None]:
        """A hook TensorRT-LLM calls at the end of every forward pass, also
        after a CUDA-graph replay, on the forward stream: it records an event
        there so wait_for_save waits for exactly the forward pass, not for the
        whole stream."""
        return self._forward_done

    def _forward_done(self) -> None:
        if not self._cuda or self._failed is not None:
            return
        try:
            import torch

            if self._fwd_event is None:
                self._fwd_event = torch.cuda.Event()
            self._fwd_event.record()
            self._fwd_recorded = True
        except Exception as e:  # noqa: BLE001
            self._fail("forward_pass_callable", e)

    @guarded(None)
    def wait_for_save(self, stream: Any = None) -> None:
        if self._worker is None:
            return
        if not self._save_due:  # the bound step has nothing to save
            self._fwd_recorded = False
            return
        self._save_due = False
        if self._cuda:
            # The forward pass is only enqueued when this is called; the copies
            # must read what it wrote.
            if self._fwd_recorded:
                self._fwd_event.synchronize()
            elif stream is not None:
                stream.synchronize()
            self._fwd_recorded = False
        self._worker.wait_for_save()

    def get_finished(
        self, finished_gen_req_ids: Iterable[int] | None, started_loading_req_ids: Iterable[int] | None,
    ) -> tuple[list[int], list[int]]:
        """(finished saving, finished loading) ids of this rank.

        Saves: kvbm's leader never reports a save in flight (request_finished
        returns False), so an id passed in finished_gen_req_ids has nothing
        outstanding here and is returned at once.
        Loads: an id is returned once TensorRT-LLM announced it and this
        rank's copies completed, and never twice (the engine indexes its
        pending set with what we return).
        """
        saving = [int(r) for r in finished_gen_req_ids or ()]
        for rid in started_loading_req_ids or ():
            self._announced.setdefault(int(rid), 0)
        if self._failed is None and self._worker is not None and self._inflight:
            try:
                loaded, errors = self._worker.finished()
            except Exception as e:  # noqa: BLE001
                self._fail("get_finished", e)
            else:
                self._note_loaded(loaded, errors)
        if self._failed is not None or self._worker is None:
            # Nothing will complete these loads any more: answer the engine
            # rather than leave the requests waiting forever.
            if self._inflight:
                log.error("kvbm: rank %d cannot complete the loads of requests %s; their KV for the matched "
                          "prefix is not valid (TensorRT-LLM has no way to recompute it)",
                          self._rank, sorted(self._inflight))
                self._done.update(self._inflight)
                self._inflight.clear()
        loading: list[int] = []
        for rid in list(self._announced):
            if rid in self._done:
                loading.append(rid)
                self._done.discard(rid)
                del self._announced[rid]
            elif rid not in self._inflight:
                self._announced[rid] += 1
                if self._announced[rid] >= _ORPHAN_LOAD_GRACE:
                    log.error("kvbm: rank %d: request %d was announced as loading but no plan carried its load; "
                              "reporting it finished so it does not wait forever", self._rank, rid)
                    loading.append(rid)
                    del self._announced[rid]
        return saving, loading

    def _note_loaded(self, loaded: Iterable[str | int], errors: list[int]) -> None:
        for rid in loaded:
            self._inflight.pop(int(rid), None)
            self._done.add(int(rid))
        if errors:
            LOCAL.add_load_errors(errors)
            # The leader (same process on rank 0) drops the failed sources so
            # they are not served again. The engine cannot be told to
            # recompute these blocks: say so plainly.
            log.error("kvbm: rank %d: %d block loads failed (G1 blocks %s); TensorRT-LLM has no load-error "
                      "path, so those requests run with invalid KV for these blocks",
                      self._rank, len(errors), sorted(errors)[:16])
