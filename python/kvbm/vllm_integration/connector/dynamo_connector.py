"""``DynamoConnector``: vLLM's KV connector v1 interface over kvbm's Go leader
and worker.

The scheduler-side instance (role SCHEDULER, in vLLM's EngineCore process)
owns a :class:`kvbm._core.Leader`; each worker-side instance (role WORKER,
one per tensor-parallel rank) owns a :class:`kvbm._core.Worker`. The adapter
only turns vLLM objects into plain lists and back: matching, offload planning
and byte movement happen in Go.

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
own (``_inflight_loads``).

Anything kvbm cannot handle (multimodal prompts, hybrid models with several
KV cache groups, device tensors without the CUDA build) is bypassed with a log
line: the engine keeps serving, those requests just get no external hits and
their KV is not offloaded (a multimodal prompt's token ids do not identify
its KV, so storing it under them could serve it to another prompt).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbm import _native, _plan
from kvbm._adapter_common import guarded

if TYPE_CHECKING:
    from kvbm._core import ConsolidatorOptions, Leader, Worker
    from kvbm._wire import BackgroundPump, WireLeader, WireWorker

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

try:  # worker → scheduler metadata (vLLM ≥ 0.32); without it G4 matching waits for nothing
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except Exception:  # pragma: no cover - older vLLM or none
    KVConnectorWorkerMetadata = None


if KVConnectorWorkerMetadata is not None:

    @dataclass
    class KvbmWorkerMeta(KVConnectorWorkerMetadata):
        """What workers tell the scheduler-side leader each step (vLLM may run
        them in other processes): rank 0's block fingerprint, which names its
        G4 objects (the leader looks G4 blocks up under it), and each rank's
        G4 report (blocks it stored, its counters)."""

        g4_fingerprint: str = ""
        g4_reports: list[bytes] = field(default_factory=list)

        def aggregate(self, other: KvbmWorkerMeta) -> KvbmWorkerMeta:
            return KvbmWorkerMeta(g4_fingerprint=self.g4_fingerprint or other.g4_fingerprint,
                                  g4_reports=self.g4_reports + other.g4_reports)


try:  # vLLM versions with worker → scheduler handshake metadata
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except Exception:  # pragma: no cover - older vLLM or none

    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]  # stand-in under vLLM's name
        pass


@dataclass
class KvbmRecoveredMetadata(KVConnectorHandshakeMetadata):
    """A worker's persistent disk tier index, recovered at start, for the
    scheduler's leader (kvbm._core.Worker.recovered)."""

    recovered: bytes = b""


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
    """The model's name or path and revision: blocks kept beyond this process
    (persistent disk tier, object storage) only match the same weights."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return ""
    model = str(getattr(mc, "model", "") or "")
    rev = getattr(mc, "revision", None)
    return f"{model}@{rev}" if rev else model


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


def _single_group(kv_cache_config: Any) -> tuple[Any, str | None]:
    """The one KV cache group kvbm supports, or None with the reason."""
    if kv_cache_config is None:
        return None, "no kv_cache_config"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        return None, (f"{len(groups)} KV cache groups (hybrid or mixed-shape model); "
                      "kvbm supports models whose layers share one KV cache shape")
    return groups[0], None


class DynamoConnector(KVConnectorBase_V1):
    """kvbm as a vLLM KV connector (both roles)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # vLLM < 0.12: no kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._is_scheduler = _role_name(role).endswith("SCHEDULER")
        self._block_size = int(vllm_config.cache_config.block_size)
        self._leader: Leader | None = None
        self._worker: Worker | None = None
        # Tensor parallel > 1 only: the leader⇄worker side channel.
        self._wire: WireLeader | None = None  # scheduler
        self._pump: BackgroundPump | None = None  # scheduler
        self._wire_worker: WireWorker | None = None  # worker
        self._disabled_reason: str | None = None
        self._failed: str | None = None
        self._on_device = False
        # G4: whether this worker has the tier, and rank 0's block fingerprint
        # (worker: its own, reported to the scheduler; scheduler: as received).
        self._g4 = False
        self._g4_fingerprint = ""
        # Worker side: loads bound but not yet reported finished (request id →
        # G1 blocks), so that a failure can still answer vLLM for them; and
        # loads the scheduler gave up on before planning them.
        self._inflight_loads: dict[str, list[int]] = {}
        self._unplanned_loads: dict[str, list[int]] = {}
        # Scheduler side: requests answered with an asynchronous load
        # (request id → num_computed_tokens at matching), and loads promised
        # by update_state_after_alloc that no plan carries yet (request id →
        # their G1 blocks).
        self._async_matches: dict[str, int] = {}
        self._promised_loads: dict[str, list[int]] = {}
        if self._is_scheduler:
            self._prefer_recompute_on_load_failure()
            self._init_scheduler()
        # The worker side is created in register_kv_caches, once the tensors exist.
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ common

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future miss: vLLM need not wait for delivery.
        return False

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        log.error("kvbm disabled for this engine: %s. vLLM keeps serving without kvbm's cache tiers.", reason)

    def _fail(self, where: str, err: Exception) -> None:
        self._failed = f"{where}: {err}"
        log.error("kvbm failed in %s and is disabled for this process; vLLM keeps serving and recomputes "
                  "what kvbm would have loaded. Cause: %s", where, err)

    def _give_up_loads(self, loads: dict[str, list[int]]) -> set[str]:
        # Loads that will not complete: report them finished with every block
        # failed, so vLLM recomputes instead of waiting forever.
        for blocks in loads.values():
            self._load_errors.update(blocks)
        return set(loads)

    def _failed_finished(self) -> set[str]:
        loads, self._inflight_loads = self._inflight_loads, {}
        return self._give_up_loads(loads)

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.stop()  # TP > 1: nothing new goes out; the wire's close fails what is in flight
        for chan in (self._wire, self._wire_worker):
            if chan is not None:
                try:
                    chan.close()
                except Exception:  # pragma: no cover
                    log.exception("kvbm: error while closing the side channel")
        if self._pump is not None:
            self._pump.wait(5)
        self._wire = self._wire_worker = self._pump = None
        for obj in (self._leader, self._worker):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # pragma: no cover
                    log.exception("kvbm: error while shutting down")
        self._leader = self._worker = None

    def _side_channel_secret(self) -> str:
        # The engine instance's id: vLLM draws it at random (uuid4) when the
        # configuration is created and ships the same configuration to the
        # scheduler and every worker, and no peer outside the engine sees it.
        # It authenticates the leader/worker side channel (goext/wire/auth.go);
        # DYN_KVBM_LEADER_WORKER_SECRET, when set, is used instead.
        ktc = getattr(self._vllm_config, "kv_transfer_config", None)
        engine_id = getattr(ktc, "engine_id", None)
        return f"vllm-engine:{engine_id}" if engine_id else ""

    # --------------------------------------------------------------- scheduler

    def _prefer_recompute_on_load_failure(self) -> None:
        # kvbm is a cache: a block that cannot be loaded (failed read, checksum
        # mismatch) must be recomputed, not fail the request. vLLM's default
        # policy is "fail"; its scheduler reads the policy after creating this
        # connector, so it can be set here. kv_connector_extra_config
        # {"kv_load_failure_policy": "fail"} keeps vLLM's behaviour.
        ktc = getattr(self._vllm_config, "kv_transfer_config", None)
        if ktc is None or not hasattr(ktc, "kv_load_failure_policy"):
            return
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        wanted = extra.get("kv_load_failure_policy", "recompute")
        if ktc.kv_load_failure_policy != wanted:
            try:
                ktc.kv_load_failure_policy = wanted
                log.info("kvbm: kv_load_failure_policy=%s (a failed kvbm load is recomputed)", wanted)
            except Exception as e:  # noqa: BLE001 - frozen config: keep vLLM's policy
                log.warning("kvbm: could not set kv_load_failure_policy=%s: %s", wanted, e)

    def _init_scheduler(self) -> None:
        from kvbm._core import Leader
        from kvbm.vllm_integration.consolidator_config import get_consolidator_endpoints, should_enable_consolidator

        group, why = _single_group(self._kv_cache_config)
        if group is None:
            self._disable(str(why))
            return
        spec = group.kv_cache_spec
        num_layers = len(group.layer_names)
        bytes_per_block = int(spec.page_size_bytes) * num_layers
        _, tp_size = _tp(self._vllm_config)
        consolidator: ConsolidatorOptions | None = None
        if should_enable_consolidator(self._vllm_config):
            engine_ep, out_bind, _ = get_consolidator_endpoints(self._vllm_config)
            consolidator = {"engine": "vllm", "engine_endpoint": engine_ep, "zmq_bind": out_bind}
        if tp_size > 1:
            bytes_per_block = self._start_wire(tp_size)
        self._leader = Leader(
            block_size=self._block_size,
            bytes_per_block=bytes_per_block,
            num_workers=tp_size,
            consolidator=consolidator,
            background=tp_size > 1,
            g4_async=True,  # vLLM asks again when told "not ready yet" (None)
        )
        if self._wire is not None:
            from kvbm._wire import BackgroundPump

            self._pump = BackgroundPump(self._wire, self._leader)
        info = self._leader.info()
        log.info(
            "kvbm leader ready (pid %d): block_size=%d layers=%d bytes_per_block=%d tp=%d host_blocks=%d "
            "disk_blocks=%d consolidator=%s metrics=%s",
            os.getpid(), self._block_size, num_layers, bytes_per_block, tp_size, info["host_blocks"],
            info["disk_blocks"], bool(consolidator), info.get("metrics_addr", "off"),
        )
        self._requests: dict[str, Any] = {}
        self._sent_tokens: dict[str, int] = {}
        self._salts: dict[str, int] = {}
        self._bypassed: set[str] = set()  # multimodal / embedding prompts
        self._loaded: list[str] = []
        self._invalid_blocks: list[int] = []
        self._seq = 0

    def _start_wire(self, tp_size: int) -> int:
        """TP > 1: bind the side channel and wait until every rank's worker
        reported and allocated (vLLM registers the workers' KV caches before
        it creates the scheduler). Returns one rank's bytes per block.

        Errors propagate: a taken port or a rank that never answers is a
        configuration error, and the message names the variable to change
        (DYN_KVBM_LEADER_ZMQ_PUB_PORT / _ACK_PORT,
        DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)."""
        from kvbm._wire import WireLeader

        self._wire = WireLeader(num_workers=tp_size, secret=self._side_channel_secret())
        try:
            hs = self._wire.handshake()
        except BaseException:
            self._wire.close()
            self._wire = None
            raise
        info = self._wire.info()
        log.info("kvbm side channel ready: %d ranks, transport %s, pub port %s, ack port %s, "
                 "bytes_per_block=%d per rank", hs.num_workers, info["transport"], info["pub_port"],
                 info["ack_port"], hs.bytes_per_block)
        return int(hs.bytes_per_block)

    def _salt(self, request: Any) -> int:
        rid = request.request_id
        s = self._salts.get(rid)
        if s is None:
            s = _native.salt_hash(getattr(request, "cache_salt", None), _lora_name(request))
            self._salts[rid] = s
        return s

    @guarded((0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._leader is None:
            return 0, False
        if _bypassed(request):
            log.debug("kvbm: request %s bypassed (multimodal or prompt embeddings)", request.request_id)
            return 0, False
        tokens = request.all_token_ids
        got, is_async = self._leader.match(request.request_id, tokens, self._salt(request), num_computed_tokens)
        if got == self._leader.PENDING:
            # A G4 lookup for this request is running: vLLM keeps the request
            # waiting and asks again on a later step.
            self._async_matches.pop(request.request_id, None)
            return None, False
        if got and is_async:
            self._async_matches[request.request_id] = int(num_computed_tokens)
        else:
            self._async_matches.pop(request.request_id, None)
        return got, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # The promise is recorded even when kvbm has failed since matching:
        # vLLM now waits for this load, and only a worker can release it.
        try:
            self._record_promised_load(request, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - the engine must survive
            self._fail("update_state_after_alloc", e)
        self._update_state_after_alloc(request, blocks, num_external_tokens)

    def _record_promised_load(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        computed = self._async_matches.pop(request.request_id, None)
        if computed is None or num_external_tokens <= 0:
            return
        bs = self._block_size
        first = computed // bs
        block_ids = list(blocks.get_block_ids()[0])
        self._promised_loads[request.request_id] = block_ids[first:first + -(-num_external_tokens // bs)]

    @guarded(None)
    def _update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._leader is None:
            return
        rid = request.request_id
        if _bypassed(request):
            self._bypassed.add(rid)  # never offloaded either
            return
        self._requests[rid] = request
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            self._leader.update_after_alloc(rid, block_ids, num_external_tokens)

    def _failure_meta(self) -> DynamoConnectorMetadata:
        """The metadata of a step kvbm could not plan: the promised loads that
        no plan carries go to the workers as failed."""
        failed, self._promised_loads = self._promised_loads, {}
        return DynamoConnectorMetadata(failed_loads=failed)

    @guarded(lambda self: self._failure_meta())
    def build_connector_meta(self, scheduler_output: Any) -> DynamoConnectorMetadata:
        if self._leader is None:
            return DynamoConnectorMetadata()
        num_sched = scheduler_output.num_scheduled_tokens
        # Rows carry no priority: vLLM's request priority orders scheduling,
        # not retention, so the offload filter never applies under vLLM.
        updates: list[list[object]] = []
        for nr in scheduler_output.scheduled_new_reqs:
            rid = nr.req_id
            if rid in self._bypassed:
                continue
            req = self._requests.get(rid)
            tokens = list(req.all_token_ids) if req is not None else list(nr.prompt_token_ids or [])
            self._sent_tokens[rid] = len(tokens)
            updates.append([
                rid, tokens, list(nr.block_ids[0]) if nr.block_ids else [], int(nr.num_computed_tokens),
                int(num_sched.get(rid, 0)), None, self._salt(req) if req is not None else _native.salt_hash(), False,
            ])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            is_resumed = rid in resumed
            all_tokens = req.all_token_ids
            if is_resumed:
                tokens = list(all_tokens)
            else:
                tokens = list(all_tokens[self._sent_tokens.get(rid, 0):])
            self._sent_tokens[rid] = len(all_tokens)
            updates.append([
                rid, tokens, list(new_blocks[0]) if new_blocks else [], int(cached.num_computed_tokens[i]),
                int(num_sched.get(rid, 0)), None, self._salt(req), is_resumed,
            ])
        loaded, self._loaded = self._loaded, []
        invalid, self._invalid_blocks = self._invalid_blocks, []
        plan = self._leader.step(updates, loaded, invalid)
        if self._pump is not None:
            # TP > 1: G2→G3 moves go to every rank over the side channel, off
            # this thread; dead ranks put the leader in degraded mode.
            try:
                self._pump.poll()
            except Exception as e:  # noqa: BLE001 - only disk offload is lost
                log.warning("kvbm: background operation not started: %s", e)
        for rid in scheduler_output.finished_req_ids or ():
            self._forget(rid)
        self._seq += 1
        # The leader emits every load it planned in the next step: the loads
        # promised so far are in this plan, and the workers own them now.
        self._promised_loads.clear()
        return DynamoConnectorMetadata(plan=plan, seq=self._seq)

    @guarded(None)
    def update_connector_output(self, connector_output: Any) -> None:
        if self._leader is None:
            return
        recv = getattr(connector_output, "finished_recving", None)
        if recv:
            self._loaded.extend(recv)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._invalid_blocks.extend(int(b) for b in invalid)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        fp = getattr(meta, "g4_fingerprint", "")
        if fp and fp != self._g4_fingerprint:
            # Rank 0's worker names its G4 objects by this: lookups start.
            self._leader.set_g4_fingerprint(fp)
            self._g4_fingerprint = fp
        for rep in getattr(meta, "g4_reports", None) or ():
            self._leader.g4_report(rep)

    @guarded((False, None))
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self._leader is None:
            return False, None
        pending = self._leader.request_finished(request.request_id)
        return pending, None

    def _forget(self, rid: str) -> None:
        self._async_matches.pop(rid, None)
        self._requests.pop(rid, None)
        self._sent_tokens.pop(rid, None)
        self._salts.pop(rid, None)
        self._bypassed.discard(rid)

    def take_events(self) -> tuple[()]:
        return ()

    @guarded(False)
    def reset_cache(self) -> bool:
        if self._leader is not None:
            self._leader.reset()
        return True

    def get_finished_count(self) -> int | None:
        return None

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Scheduler: vLLM hands over what every worker's
        get_handshake_metadata returned (tp rank → metadata) once the KV
        caches are registered, before the first step: register the disk
        tier blocks every rank's persistent tier recovered."""
        if self._leader is None or not metadata:
            return
        _, tp_size = _tp(self._vllm_config)
        recs = [getattr(metadata.get(r), "recovered", b"") for r in range(tp_size)]
        if not all(recs):
            return  # no persistent disk tier (or a rank without one)
        try:
            n = self._leader.restore_disk(recs)
            log.info("kvbm: %d disk tier blocks recovered from the persistent tier of %d rank(s)", n, tp_size)
        except Exception as e:  # noqa: BLE001 - a cache that starts empty still serves
            log.warning("kvbm: persistent disk tier not restored (starting with an empty disk tier index): %s", e)

    # ------------------------------------------------------------------ worker

    @guarded(None)
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvbm._core import Worker

        if self._kv_cache_config is not None:
            _, why = _single_group(self._kv_cache_config)
            if why is not None:
                self._disable(why)
                return
        try:
            tensors, kind, dtype_bytes = self._describe_caches(kv_caches)
        except ValueError as e:
            self._disable(str(e))
            return
        rank, tp_size = _tp(self._vllm_config)
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        if num_blocks is None:
            num_blocks = next(iter(kv_caches.values())).shape[0]
        self._on_device = next(iter(kv_caches.values())).device.type == "cuda"
        self._kv_caches = kv_caches  # keep the engine's tensors alive as long as we hold their addresses
        self._worker = Worker(
            tensors=tensors, kind=kind, num_blocks=int(num_blocks), block_size=self._block_size,
            dtype_bytes=dtype_bytes, rank=rank, num_workers=tp_size,
            model=_model_identity(self._vllm_config), dtype=str(next(iter(kv_caches.values())).dtype),
        )
        if tp_size > 1:
            # The scheduler's leader handshakes with every rank over the side
            # channel; this returns at once (the scheduler does not exist yet).
            from kvbm._wire import WireWorker

            self._wire_worker = WireWorker(self._worker, rank=rank, num_workers=tp_size,
                                           secret=self._side_channel_secret())
        info = self._worker.info()
        self._g4 = bool(info.get("g4"))
        if self._g4 and rank == 0:
            self._g4_fingerprint = info["fingerprint"]
        log.info("kvbm worker ready (pid %d, rank %d): layout %s, %d layers, bytes_per_block=%d, host_blocks=%d, "
                 "disk_blocks=%d", os.getpid(), rank, info["layout"], info["num_layers"], info["bytes_per_block"],
                 info["host_blocks"], info["disk_blocks"])

    def get_handshake_metadata(self) -> KvbmRecoveredMetadata | None:
        """Worker: this rank's recovered persistent disk tier index (None
        without one), which vLLM passes to the scheduler's connector."""
        if self._worker is None:
            return None
        try:
            rec = self._worker.recovered()
        except Exception as e:  # noqa: BLE001
            log.warning("kvbm: could not read the recovered disk tier index: %s", e)
            return None
        return KvbmRecoveredMetadata(recovered=rec) if rec else None

    def _describe_caches(
        self, kv_caches: dict[str, Any],
    ) -> tuple[list[tuple[int, list[int], list[int]]], str, int]:
        from kvbm._layers import order_layers

        names = order_layers(list(kv_caches))
        first = kv_caches[names[0]]
        if first.device.type != "cpu" and _native.library_path()[1] != "cuda":
            raise ValueError(
                f"KV cache tensors are on {first.device} but the loaded kvbm library has no CUDA support "
                "(build it with `make cuda`)")
        nd = first.dim()
        if first.device.type == "cpu":
            kind = "cpu_paged" if nd == 4 else ("cpu" if nd == 5 else "mla")
        elif nd == 5:
            kind = "flash_attn" if first.shape[0] == 2 else "flashinfer"
        elif nd == 3:
            kind = "mla"
        else:
            raise ValueError(f"cannot interpret KV cache tensor shape {tuple(first.shape)}")
        tensors = [(t.data_ptr(), list(t.shape), list(t.stride())) for t in (kv_caches[n] for n in names)]
        return tensors, kind, first.element_size()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._unplanned_loads.update(getattr(connector_metadata, "failed_loads", None) or {})
        plan = getattr(connector_metadata, "plan", b"")
        if not plan:
            return
        try:
            self._inflight_loads.update(_plan.load_targets(plan))
        except Exception as e:  # noqa: BLE001
            self._fail("bind_connector_metadata", e)
            return
        if self._failed is None and self._worker is not None:
            try:
                self._worker.bind(plan)
            except Exception as e:  # noqa: BLE001
                self._fail("bind_connector_metadata", e)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()

    def _sync_engine_stream(self) -> None:
        # CUDA: our copies must follow the engine's writes (saves) and reads
        # of the blocks being replaced (loads) on its current stream.
        if self._on_device and self._worker is not None:
            import torch

            self._worker.set_cuda_stream(torch.cuda.current_stream().cuda_stream)

    @guarded(None)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._sync_engine_stream()
            self._worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Saves run in wait_for_save, once the whole step has been written: layer
        # hooks are skipped under full CUDA graphs and on steps without attention.
        return None

    @guarded(None)
    def wait_for_save(self) -> None:
        if self._worker is not None:
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
        try:
            loaded, errors = self._worker.finished()
        except Exception as e:  # noqa: BLE001
            self._fail("get_finished", e)
            return None, (done | self._failed_finished()) or None
        for rid in loaded:
            self._inflight_loads.pop(rid, None)
        if errors:
            self._load_errors.update(errors)
            log.warning("kvbm: %d block loads failed; vLLM recomputes them", len(errors))
        return None, (done | set(loaded)) or None

    @guarded(None)
    def build_connector_worker_meta(self) -> KvbmWorkerMeta | None:
        if KVConnectorWorkerMetadata is None or self._worker is None or not self._g4:
            return None
        rep = self._worker.g4_report()
        # Only rank 0's acknowledgements name blocks the leader can look up.
        return KvbmWorkerMeta(g4_fingerprint=self._g4_fingerprint, g4_reports=[rep] if rep else [])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs
