"""The worker side of :class:`~kvbm.vllm_integration.connector.DynamoConnector`
(role WORKER, one per tensor-parallel rank): it owns a
:class:`kvbm._core.Worker`, created in ``register_kv_caches`` once the KV
cache tensors exist; with tensor parallelism that worker also holds the side
channel's end, which runs the leader's background operations in Go.

Each step ``bind_connector_metadata`` hands the plan to the worker (Go
decodes it and answers with the loads this rank must report and which of the
step's calls have work), ``start_load_kv`` starts its loads (G2/G3 → G1,
asynchronous), ``wait_for_save`` runs its offloads (G1 → G2, G2 → G3) once
the forward pass has written the step's KV, and ``get_finished`` reports
finished loads; a call without work does not cross into Go. Load
failures (a G3 block whose checksum does not verify, an I/O error) are
reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them;
after a kvbm failure every load still owed to vLLM (``_inflight_loads``, and
the scheduler's ``failed_loads``) is reported finished with its blocks failed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvbm import _native
from kvbm._adapter_common import guarded, plan_loads
from kvbm.vllm_integration.connector._common import (
    KVConnectorWorkerMetadata,
    KvbmRecoveredMetadata,
    VllmSide,
    _model_identity,
    _side_channel_secret,
    _tp,
    log,
)
from kvbm.vllm_integration.connector._stats import KvbmConnectorStats
from kvbm.vllm_integration.connector._groups import kv_groups, state_views

if TYPE_CHECKING:
    from kvbm._core import Worker
    from kvbm.vllm_integration.connector._common import KvbmWorkerMeta


_XFER_FIELDS = ("blocks", "failed", "bytes", "seconds", "batches")


class VllmConnectorWorker(VllmSide):
    """kvbm's worker-side connector for vLLM (one tensor-parallel rank)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        self._worker: Worker | None = None
        self._kv_caches: dict[str, Any] = {}
        self._on_device = False
        # G4: whether this worker has the tier, and rank 0's block fingerprint
        # (its own, reported to the scheduler in the handshake metadata).
        self._g4 = False
        self._g4_fingerprint = ""
        self._loads_done = False  # loads finished since the last worker metadata: timings to send
        # Loads bound but not yet reported finished (request id → G1 blocks),
        # so that a failure can still answer vLLM for them; and loads the
        # scheduler gave up on before planning them.
        self._inflight_loads: dict[str, list[int]] = {}
        self._unplanned_loads: dict[str, list[int]] = {}
        self._load_errors: set[int] = set()
        # Whether the bound step's start_load / wait_for_save have work (the
        # worker's bind says so); a call without work is not made.
        self._start_due = False
        self._save_due = False
        # Connector stats (get_kv_connector_stats): the Go worker's transfer
        # totals at the last report, and load errors since it.
        self._rank = 0
        self._xfer_reported: dict[str, dict[str, float]] = {}
        self._xfer_seq = -1  # the worker's transfer_seq when its totals were last read
        self._stat_load_errors = 0
        # Several KV cache groups: vLLM maps failed block ids to requests
        # only with one group, so a load with any failed block fails its
        # whole request (reported in failed_recving; vLLM recomputes it).
        self._multi_group = False
        self._failed_recving: set[str] = set()
        self._group_load_errors: list[int] = []  # for the leader, through the worker metadata

    def _give_up_loads(self, loads: dict[str, list[int]]) -> set[str]:
        # Loads that will not complete: report them finished with every block
        # failed, so vLLM recomputes instead of waiting forever.
        if self._multi_group:
            self._failed_recving.update(loads)
            return set(loads)
        for blocks in loads.values():
            self._load_errors.update(blocks)
            self._stat_load_errors += len(blocks)
        return set(loads)

    def _failed_finished(self) -> set[str]:
        loads, self._inflight_loads = self._inflight_loads, {}
        return self._give_up_loads(loads)

    def shutdown(self) -> None:
        # One handle: closing it closes the side channel first (an operation
        # waiting for its engine step returns), then the worker.
        if self._worker is not None:
            try:
                self._worker.close()
            except Exception:  # pragma: no cover
                log.exception("kvbm: error while shutting down")
        self._worker = None

    @guarded(None)
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvbm._core import Worker

        layer_groups: list[int] | None = None
        group_kinds: list[str] | None = None
        groups = None
        if self._kv_cache_config is not None:
            groups, why = kv_groups(self._kv_cache_config, self._block_size)
            if groups is None:
                self._disable(str(why))
                return
            if groups.num_groups > 1:  # one group needs no layer map, even with rows
                from kvbm._layers import order_layers

                names = order_layers(list(kv_caches))
                missing = [n for n in names if n not in groups.layer_group]
                if missing:
                    self._disable(f"KV cache layers {missing} are in no KV cache group ({groups.describe()})")
                    return
                layer_groups = [groups.layer_group[n] for n in names]
                # The windows are part of the fingerprint too (a layer's KV
                # depends on every earlier layer's window).
                group_kinds = list(groups.kinds)
                self._multi_group = True
        try:
            if groups is not None and groups.has_state:
                kv_caches = state_views(kv_caches, groups)
            tensors, kind, dtype_bytes = self._describe_caches(kv_caches)
        except ValueError as e:
            self._disable(str(e))
            return
        rank, tp_size = _tp(self._vllm_config)
        self._rank = rank
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        self._on_device = next(iter(kv_caches.values())).device.type == "cuda"
        self._kv_caches = kv_caches  # keep the engine's tensors alive as long as we hold their addresses
        self._worker = Worker(
            tensors=tensors, kind=kind, num_blocks=int(num_blocks), block_size=self._block_size,
            dtype_bytes=dtype_bytes, rank=rank, num_workers=tp_size,
            model=_model_identity(self._vllm_config), dtype=str(next(iter(kv_caches.values())).dtype),
            # TP > 1: the scheduler's leader handshakes with every rank over the
            # side channel; Worker returns at once (the scheduler does not exist yet).
            side_channel={"secret": _side_channel_secret(self._vllm_config)} if tp_size > 1 else None,
            layer_groups=layer_groups, group_kinds=group_kinds,
        )
        info = self._worker.info()
        self._g4 = bool(info.get("g4"))
        if self._g4 and rank == 0:
            self._g4_fingerprint = info["fingerprint"]
        log.info("kvbm worker ready (pid %d, rank %d): layout %s, %d layers, bytes_per_block=%d, host_blocks=%d, "
                 "disk_blocks=%d", os.getpid(), rank, info["layout"], info["num_layers"], info["bytes_per_block"],
                 info["host_blocks"], info["disk_blocks"])

    def unregister_kv_caches(self) -> None:
        """The engine is about to release the KV cache memory (sleep mode):
        wait for the copies in flight, then stop kvbm on this rank for good,
        so that nothing reads or writes the old addresses. Loads still owed
        to vLLM are reported finished with their blocks failed (recomputed).
        Idempotent."""
        if self._worker is None or self._failed is not None:
            return
        try:
            self._worker.wait_loads()
        except Exception as e:  # noqa: BLE001 - the engine must survive
            log.warning("kvbm: waiting for loads before sleep: %s", e)
        self._fail("unregister_kv_caches", RuntimeError(
            "vLLM released the KV cache memory (sleep mode), which kvbm does not support"))

    def restore_kv_caches(self) -> None:
        if self._failed is not None:
            log.warning("kvbm: the KV cache is back after sleep mode; kvbm stays off for this engine")

    def get_handshake_metadata(self) -> KvbmRecoveredMetadata | None:
        """This rank's recovered persistent disk tier index and, on rank 0
        with G4, its block fingerprint (None without either), which vLLM
        passes to the scheduler's connector before the first step: the one
        route by which the leader learns them, in any process layout."""
        if self._worker is None:
            return None
        try:
            rec = self._worker.recovered()
        except Exception as e:  # noqa: BLE001
            log.warning("kvbm: could not read the recovered disk tier index: %s", e)
            rec = b""
        if not rec and not self._g4_fingerprint:
            return None
        return KvbmRecoveredMetadata(recovered=rec, g4_fingerprint=self._g4_fingerprint)

    def _describe_caches(
        self, kv_caches: dict[str, Any],
    ) -> tuple[list[tuple[int, list[int], list[int]]], str, int]:
        from kvbm._layers import order_layers

        names = order_layers(list(kv_caches))
        first = kv_caches[names[0]]
        if first.device.type != "cpu" and not _native.has_cuda():
            raise ValueError(
                f"KV cache tensors are on {first.device} but the loaded kvbm library ({_native.loaded_path()}) "
                f"is the {_native.build_info()['variant']} build, without CUDA support (build it with `make cuda`)")
        nd = first.dim()
        if nd == 4:
            # vLLM's per-layer view since its KVCacheLayout rework, on every
            # platform: [num_blocks, kv_heads, block_size, 2 × head_dim]
            # (K and V in one page; its memory order may differ, e.g. NHD).
            kind = "cpu_paged"
        elif first.device.type == "cpu":
            kind = "cpu" if nd == 5 else "mla"
        elif nd == 5:
            kind = "flash_attn" if first.shape[0] == 2 else "flashinfer"
        elif nd == 3:
            kind = "mla"
        else:
            raise ValueError(f"cannot interpret KV cache tensor shape {tuple(first.shape)}")
        tensors = [(t.data_ptr(), list(t.shape), list(t.stride())) for t in (kv_caches[n] for n in names)]
        return tensors, kind, first.element_size()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._unplanned_loads.update(getattr(connector_metadata, "failed_loads", None) or {})
        plan = getattr(connector_metadata, "plan", b"")
        if not plan:
            return
        if self._failed is None and self._worker is not None:
            # The plan is decoded in Go only: bind answers with the loads this
            # rank must report and whether the step's calls have work.
            try:
                bound = self._worker.bind(plan)
            except Exception as e:  # noqa: BLE001
                self._fail("bind_connector_metadata", e)
            else:
                self._inflight_loads.update(bound.loads)
                self._start_due = self._start_due or bound.start
                self._save_due = self._save_due or bound.save
                return
        # kvbm is off in this process (Go is not asked any more), but the
        # scheduler's leader may still plan loads vLLM now waits for: read
        # them here, so get_finished reports them failed.
        try:
            self._inflight_loads.update(plan_loads(plan))
        except Exception as e:  # noqa: BLE001
            log.warning("kvbm: could not read the loads of a plan after kvbm failed: %s", e)

    def _sync_engine_stream(self) -> None:
        # CUDA: our copies must follow the engine's writes (saves) and reads
        # of the blocks being replaced (loads) on its current stream.
        if self._on_device and self._worker is not None:
            import torch

            self._worker.set_cuda_stream(torch.cuda.current_stream().cuda_stream)

    @guarded(None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None and self._start_due:
            self._start_due = False
            self._sync_engine_stream()
            self._worker.start_load()

    @guarded(None)
    def wait_for_save(self) -> None:
        if self._worker is not None and self._save_due:
            self._save_due = False
            self._sync_engine_stream()
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        unplanned, self._unplanned_loads = self._unplanned_loads, {}
        done = self._give_up_loads(unplanned)
        if unplanned:
            log.warning("kvbm: %d promised loads were never planned (kvbm failed); vLLM recomputes them",
                        len(unplanned))
        if self._worker is None or self._failed is not None:
            return None, (done | self._failed_finished()) or None
        if not self._inflight_loads:
            return None, done or None  # no load of this rank is running: nothing to ask
        try:
            loaded, errors = self._worker.finished()
        except Exception as e:  # noqa: BLE001
            self._fail("get_finished", e)
            return None, (done | self._failed_finished()) or None
        if self._multi_group and errors:
            failed = set(self._worker.failed_requests)  # Go maps the failed blocks to their requests
            self._failed_recving.update(failed)
            self._group_load_errors.extend(errors)
            log.warning("kvbm: %d block loads failed; vLLM recomputes the whole prompt of %d request(s)",
                        len(errors), len(failed))
            errors = []
        for rid in loaded:
            self._inflight_loads.pop(rid, None)
        self._loads_done = self._loads_done or bool(loaded)
        if errors:
            self._load_errors.update(errors)
            self._stat_load_errors += len(errors)
            log.warning("kvbm: %d block loads failed; vLLM recomputes them", len(errors))
        return None, (done | set(loaded)) or None

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed (several KV cache groups only), for
        vLLM's failed_recving; each is also reported finished."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    @guarded(None)
    def build_connector_worker_meta(self) -> KvbmWorkerMeta | None:
        errors, self._group_load_errors = self._group_load_errors, []
        if KVConnectorWorkerMetadata is None or self._worker is None:
            return None
        # Rank 0's timed loads, for the leader's cost model; asked only after
        # loads finished (no extra ABI crossing on other steps).
        timings = self._worker.transfer_timings() if self._loads_done else b""
        self._loads_done = False
        if not (self._g4 or errors or timings):
            return None
        from kvbm.vllm_integration.connector._common import KvbmWorkerMeta

        rep = self._worker.g4_report() if self._g4 else b""
        # Only rank 0's acknowledgements name blocks the leader can look up.
        return KvbmWorkerMeta(g4_reports=[rep] if rep else [], load_errors=[int(b) for b in errors],
                              transfer_timings=[timings] if timings else [])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def get_kv_connector_stats(self) -> KvbmConnectorStats | None:
        """This rank's figures since the last call: blocks (rank 0 only:
        every rank moves its shard of the same blocks), bytes, batch seconds
        and failed copies per transfer direction, and failed loads. None when
        there is nothing to report."""
        # Called every step: the Go totals are read (and their changes
        # reported) only when a batch was recorded since the last read.
        dirs: dict[str, Any] = {}
        if self._worker is not None and self._failed is None:
            try:
                seq = self._worker.transfer_seq()
                if seq != self._xfer_seq:
                    dirs = self._worker.stats()["directions"]
                self._xfer_seq = seq
            except Exception as e:  # noqa: BLE001 - the engine must survive
                self._fail("get_kv_connector_stats", e)
        if not dirs and not self._stat_load_errors:
            return None
        stats = KvbmConnectorStats(data={})
        stats.add("load_errors", self._stat_load_errors)
        self._stat_load_errors = 0
        for d, totals in dirs.items():
            now: dict[str, float] = {k: float(totals.get(k, 0)) for k in _XFER_FIELDS}
            last = self._xfer_reported.get(d, {})
            delta = {k: now[k] - last.get(k, 0.0) for k in _XFER_FIELDS}
            self._xfer_reported[d] = now
            if self._rank == 0:
                stats.add("transfer_blocks", delta["blocks"], d)
            stats.add("transfer_failed_blocks", delta["failed"], d)
            stats.add("transfer_bytes", delta["bytes"], d)
            stats.add("transfer_seconds", delta["seconds"], d)
            stats.add("transfer_batches", delta["batches"], d)
        return None if stats.is_empty() else stats
