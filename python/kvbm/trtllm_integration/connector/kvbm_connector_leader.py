"""``DynamoKVBMConnectorLeader``: TensorRT-LLM's scheduler-side connector
(rank 0 only) over :class:`kvbm._core.Leader`.

TensorRT-LLM's order, per iteration (PyExecutor, both executor loops):

1. for each request added to the KV cache manager: ``get_num_new_matched_tokens``
   (once per request, from C++, while the prompt is allocated), then
   ``update_state_after_alloc`` with all its prompt blocks;
2. ``build_connector_meta`` once per forward pass: the returned bytes go to
   every rank (MPI broadcast) and each worker binds them;
3. forward pass, ``wait_for_save`` on every rank;
4. ``request_finished`` for requests that ended; ``get_finished`` on every rank.

The adapter turns TensorRT-LLM's objects into the Go leader's plain calls:
integer request ids become strings, ``RequestData`` becomes an update row
``[req_id, new_tokens, new_block_ids, num_computed, num_scheduled,
priorities (one per new block id), salt, resumed]``. Matching, planning and
deduplication live in Go.

Bytes per block: the Go leader sizes G2/G3 from it, and TensorRT-LLM gives the
scheduler no model shapes. The leader is therefore created on first use, when
rank 0's worker (same process) has registered the KV cache and reported the
exact value (see ``_common.LocalLink``). Without an in-process worker (tests,
unusual launchers) it is computed from the checkpoint's config.json, or not
needed at all when every tier is sized with ``*_OVERRIDE_NUM_BLOCKS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvbm import _native
from kvbm._adapter_common import FailureState, StepUpdate, guarded
from kvbm._record import TRTLLM_LEADER_METHODS, record_calls
from kvbm.trtllm_integration.connector._common import (
    DEFAULT_PRIORITY,
    LOCAL,
    KvCacheConnectorScheduler,
    bytes_per_block_from_model,
    check_supported,
    log,
    parallel_sizes,
    tiers_sized_by_block_count,
    tokens_per_block,
)

if TYPE_CHECKING:
    from kvbm._core import Leader, LeaderInfo


def _lora_name(request: Any) -> str | None:
    # TensorRT-LLM identifies adapters by an integer task id; its string is the
    # name that goes into kvbm's salt, so different adapters never share blocks.
    task = getattr(request, "lora_task_id", None)
    return str(task) if task is not None else None


_U64_MASK = (1 << 64) - 1


def _cache_salt(obj: Any) -> str | None:
    """The cache salt of an LlmRequest or RequestData, as kvbm's salt string.

    TensorRT-LLM keeps tenants apart with ``cache_salt_id``, a u64 that its
    LLM API derives from the request's salt string (``LlmRequest`` and newer
    ``RequestData``; some releases give ``RequestData`` the string itself as
    ``cache_salt``). kvbm mixes the id into its keys the way it mixes vLLM's
    salt string (design §3), as the string of its decimal digits:
    ``{"salt":"18446744073709551615"}``. The id thus crosses the C ABI as
    bytes, exact for every u64; an id reported as a signed 64-bit value is
    read back as the same u64.
    """
    salt_id = getattr(obj, "cache_salt_id", None)
    if salt_id is not None:
        return str(int(salt_id) & _U64_MASK)
    salt = getattr(obj, "cache_salt", None)
    return salt if isinstance(salt, str) and salt else None


class DynamoKVBMConnectorLeader(FailureState, KvCacheConnectorScheduler):
    """kvbm's TensorRT-LLM scheduler connector (rank 0)."""

    _log = log
    _engine_name = "TensorRT-LLM"

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        check_supported(llm_args)
        self._llm_args_ref = llm_args
        self._block_size = tokens_per_block(llm_args)
        self._tp = parallel_sizes(llm_args)["tp"]
        self._failed: str | None = None
        self._disabled_reason: str | None = None
        self._leader: Leader | None = None
        # A configuration error (an invalid DYN_KVBM_* value, no tier) fails
        # start-up here, naming the variable, rather than disabling kvbm later.
        _native.config_check(require_tier=True)

        # Per request (Go request id, a str):
        self._salts: dict[str, int] = {}  # salt hash, fixed at matching
        self._matched: dict[str, tuple[int, int]] = {}  # (device-computed tokens, kvbm tokens) at matching
        # Tokens the leader got at matching: the request's first row carries
        # only those after them (each token crosses the C ABI once).
        self._matched_tokens: dict[str, int] = {}
        self._loading: set[str] = set()  # load planned; not yet seen back in the batch
        self._seen: set[str] = set()  # has been in a Step (a later "new" appearance is a replay)
        # For the next Step:
        self._loaded: list[str] = []  # requests whose loads ended
        record_calls(self, "trtllm", TRTLLM_LEADER_METHODS)  # DYN_KVBM_ENABLE_RECORD

    # ------------------------------------------------------------ lifecycle

    def _disable(self, reason: str) -> None:
        self._disabled_reason = reason
        log.error("kvbm disabled for this engine: %s. TensorRT-LLM keeps serving without kvbm's cache tiers.",
                  reason)

    def _bytes_per_block(self) -> int | None:
        if LOCAL.bytes_per_block:
            return LOCAL.bytes_per_block
        try:
            bpb = bytes_per_block_from_model(self._llm_args_ref, self._tp)
        except Exception as e:  # noqa: BLE001 - an unreadable config is just "unknown"
            log.warning("kvbm: could not read the model's config.json for the block size in bytes: %s", e)
            bpb = None
        if bpb:
            log.info("kvbm leader: bytes per block %d from the checkpoint's config.json (no worker in this "
                     "process)", bpb)
            return bpb
        if tiers_sized_by_block_count():
            # Sizing ignores bytes per block when every tier has a block count.
            return 1
        return None

    def _ensure_leader(self) -> Leader | None:
        if self._leader is not None or self._disabled_reason is not None:
            return self._leader
        if LOCAL.worker_failed:
            self._disable(f"the worker in this process failed ({LOCAL.worker_failed})")
            return None
        bpb = self._bytes_per_block()
        if bpb is None:
            self._disable(
                "the block size in bytes is unknown: no kvbm worker registered its KV cache in this process, the "
                "model has no readable config.json, and the tiers are sized in GB. Set "
                "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS (and DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS) instead")
            return None
        from kvbm._core import Leader
        from kvbm.trtllm_integration.consolidator_config import consolidator_options

        cons = consolidator_options(self._llm_args_ref)
        self._leader = Leader(block_size=self._block_size, bytes_per_block=bpb, num_workers=self._tp,
                              consolidator=cons, fingerprint=LOCAL.fingerprint)
        recovered = LOCAL.take_recovered(self._tp)
        if recovered:
            try:
                n = self._leader.restore_disk(recovered)
                log.info("kvbm: %d disk tier blocks recovered from the persistent tier", n)
            except Exception as e:  # noqa: BLE001 - a cache that starts empty still serves
                log.warning("kvbm: persistent disk tier not restored (starting with an empty disk tier index): %s",
                            e)
        info = self._leader.info()
        log.info("kvbm leader ready (pid %d): block_size=%d bytes_per_block=%d tp=%d host_blocks=%d "
                 "disk_blocks=%d consolidator=%s metrics=%s", os.getpid(), self._block_size, bpb, self._tp,
                 info["host_blocks"], info["disk_blocks"], bool(cons), info.get("metrics_addr", "off"))
        return self._leader

    @guarded(None)
    def wait_for_initialization(self) -> None:
        """Newer TensorRT-LLM calls this after register_kv_caches: create the
        Go leader now rather than on the first request."""
        self._ensure_leader()

    def shutdown(self) -> None:
        if self._leader is not None:
            try:
                self._leader.close()
            except Exception:  # pragma: no cover
                log.exception("kvbm: error while shutting down the leader")
            self._leader = None

    # ------------------------------------------------------------- requests

    def _salt(self, rid: str, source: Any) -> int:
        """The request's salt hash, fixed when it is first seen: at matching
        (source: the LlmRequest) or, unmatched, at its first step (source:
        its RequestData)."""
        s = self._salts.get(rid)
        if s is None:
            s = _native.salt_hash(_cache_salt(source), _lora_name(source))
            self._salts[rid] = s
        return s

    @guarded((0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        leader = self._ensure_leader()
        if leader is None:
            return 0, False
        rid = str(request.request_id)
        if getattr(request, "multimodal_hashes", None) or getattr(request, "multimodal_positions", None):
            # Token ids do not identify multimodal prompts' KV.
            log.debug("kvbm: request %s bypassed (multimodal)", rid)
            return 0, False
        tokens = request.get_tokens(0)
        got, _ = leader.match(rid, tokens, self._salt(rid, request), int(num_computed_tokens))
        self._matched_tokens[rid] = len(tokens)  # the leader keeps them, whatever it answered
        if got <= 0:
            # (0, True) is illegal in TensorRT-LLM.
            self._matched.pop(rid, None)
            return 0, False
        self._matched[rid] = (int(num_computed_tokens), got)
        # Always asynchronous: the request leaves the batch until every rank
        # reports its load finished.
        return got, True

    @guarded(None)
    def update_state_after_alloc(self, request: Any, block_ids: Iterable[int]) -> None:
        """block_ids are all the prompt's blocks (device hits included): the
        Go leader loads into those after the tokens computed at matching."""
        if self._leader is None:
            return
        rid = str(request.request_id)
        m = self._matched.get(rid)
        if m is None:
            return
        self._leader.update_after_alloc(rid, list(block_ids), m[1])
        self._loading.add(rid)

    @staticmethod
    def _block_priorities(rd: Any, n: int) -> list[int]:
        """The retention priority of each of the n new block ids of rd, for
        eviction order and the offload filter
        (DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY, per block: design §4).

        RequestData.priorities has one per new block, or is None without a
        retention config; a block without one has TensorRT-LLM's default
        priority, as it has in the engine's own cache.
        """
        prios = [int(p) for p in (getattr(rd, "priorities", None) or ())[:n]]
        return prios + [DEFAULT_PRIORITY] * (n - len(prios))

    @guarded(b"")
    def build_connector_meta(self, scheduler_output: Any) -> bytes:
        leader = self._ensure_leader()
        if leader is None:
            return b""
        updates: list[StepUpdate] = []
        for rd in getattr(scheduler_output, "new_requests", None) or ():
            rid = str(rd.request_id)
            # A request seen before and reported as new again was reset and is
            # replayed (its allocation died): its token and block lists start over.
            resumed = rid in self._seen
            if rid in self._loading:
                # Back in the batch: TensorRT-LLM saw its load finished on every rank.
                self._loading.discard(rid)
                self._loaded.append(rid)
            computed = int(rd.computed_position)
            m = self._matched.pop(rid, None)
            if m is not None:
                # TensorRT-LLM subtracts the connector's tokens from
                # computed_position when it loads synchronously; after an
                # asynchronous load it does not. Either way the KV up to the
                # matched prefix is in G1 now.
                computed = max(computed, m[0] + m[1])
            blocks = list(rd.new_block_ids)
            tokens = list(rd.new_tokens)
            # Matched: the leader has the prompt's first tokens already. A
            # replayed request was not matched again: all of its tokens go.
            known = self._matched_tokens.pop(rid, 0)
            if resumed or known > len(tokens):
                known = 0
            updates.append(StepUpdate(
                req_id=rid, new_tokens=tokens[known:], new_block_ids=blocks, num_computed=computed,
                num_scheduled=self._scheduled(rd), priority=self._block_priorities(rd, len(blocks)),
                salt=self._salt(rid, rd), resumed=resumed, known_tokens=known,
            ))
            self._seen.add(rid)
        for rd in getattr(scheduler_output, "cached_requests", None) or ():
            rid = str(rd.request_id)
            if rid not in self._seen:
                # Never reported as new (kvbm started after it): its prompt is
                # unknown, so it is left alone.
                continue
            # Block ids may be resent in full or overlap what the slot has;
            # the Go leader keeps only what follows the overlap.
            blocks = list(rd.new_block_ids)
            updates.append(StepUpdate(
                req_id=rid, new_tokens=list(rd.new_tokens), new_block_ids=blocks,
                num_computed=int(rd.computed_position), num_scheduled=self._scheduled(rd),
                priority=self._block_priorities(rd, len(blocks)), salt=self._salts.get(rid, 0), resumed=False,
            ))
        loaded, self._loaded = self._loaded, []
        return leader.step(updates, loaded, LOCAL.take_load_errors())

    @staticmethod
    def _scheduled(rd: Any) -> int:
        n = getattr(rd, "num_scheduled_tokens", None)
        if n is None:
            raise RuntimeError("RequestData has no num_scheduled_tokens: kvbm needs TensorRT-LLM 1.2.0rc2 or newer")
        return int(n)

    @guarded(False)
    def request_finished(self, request: Any, cache_block_ids: Any) -> bool:
        """Always False: no kvbm save is in flight when TensorRT-LLM asks.

        The Go leader plans a request's saves in the build_connector_meta of
        the step that computes the blocks, and every rank runs them inside
        that step's wait_for_save, synchronously. TensorRT-LLM calls
        wait_for_save right after the forward pass (PyExecutor._forward_step)
        and request_finished only later, while handling responses: in the
        plain loop for the step just run, and with the overlap scheduler for
        the previous step, after the current step's wait_for_save. On each
        rank that rank's wait_for_save precedes its own freeing of the blocks.
        So returning True would only hold blocks for nothing (and returning
        True with nothing pending hangs requests).
        """
        if self._leader is None:
            return False
        rid = str(request.request_id)
        if rid in self._loading:
            # Finished (cancelled) while its load ran: TensorRT-LLM keeps a
            # loading request allocated until every rank reported the load, so
            # by now the copies are done and their sources can be released.
            self._loading.discard(rid)
            self._loaded.append(rid)
        pending = self._leader.request_finished(rid)
        self._forget(rid)
        return pending

    def _forget(self, rid: str) -> None:
        self._salts.pop(rid, None)
        self._matched.pop(rid, None)
        self._matched_tokens.pop(rid, None)
        self._seen.discard(rid)

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """KVCacheManagerV2 withdraws part of a promised load (tokens
        [start, end)) it can no longer host. kvbm plans a load whole, so it
        drops the request's load and turns itself off rather than copy into
        pages the runtime did not reserve."""
        rid = str(request.request_id)
        if self._leader is not None:
            try:
                self._leader.request_finished(rid)  # unstages the load, releases its sources
            except Exception:  # noqa: BLE001 - disabled below either way
                log.exception("kvbm: dropping the cancelled load of request %s", rid)
        self._forget(rid)
        self._loading.discard(rid)
        if self._failed is None:
            self._fail("cancel_load", RuntimeError(
                f"TensorRT-LLM cancelled tokens [{start}, {end}) of request {rid}'s load (KVCacheManagerV2); "
                "kvbm supports the V1 KV cache manager: set kv_cache_config.use_kv_cache_manager_v2 to false"))

    @guarded(False)
    def reset_cache(self) -> bool:
        """Forget every G2/G3 block (not called by TensorRT-LLM itself)."""
        if self._leader is not None:
            self._leader.reset()
        return True

    def info(self) -> LeaderInfo | dict[str, Any]:
        """The Go leader's sizes and hit rates (creating it if needed; empty
        when kvbm is disabled)."""
        leader = self._ensure_leader() if self._failed is None else None
        return leader.info() if leader is not None else {}
