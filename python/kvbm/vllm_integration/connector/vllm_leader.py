"""The scheduler side of :class:`~kvbm.vllm_integration.connector.DynamoConnector`
(role SCHEDULER, in vLLM's EngineCore process): it owns a
:class:`kvbm._core.Leader`; with tensor parallelism that leader also owns the
side channel to the workers and sends its background operations over it.

Each step ``build_connector_meta`` sends what was scheduled to the leader and
ships the returned plan (bytes) in :class:`DynamoConnectorMetadata`. A load
promised to vLLM (``update_state_after_alloc`` with external tokens) keeps
the request waiting until the workers report it finished; if kvbm fails
before that load is in a plan, the next metadata names it in
``failed_loads`` so the workers report it failed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvbm import _native
from kvbm._adapter_common import StepUpdate, guarded
from kvbm.vllm_integration.connector._common import (
    DynamoConnectorMetadata,
    VllmSide,
    _bypassed,
    _lora_name,
    _side_channel_secret,
    _tp,
    log,
)
from kvbm.vllm_integration.connector._events import TierEvents, events_enabled
from kvbm.vllm_integration.connector._stats import KvbmConnectorStats
from kvbm.vllm_integration.connector._groups import (
    NULL_BLOCK_ID,
    GroupLayout,
    kv_groups,
)

if TYPE_CHECKING:
    from kvbm._core import ConsolidatorOptions, KVGroupsOptions, Leader


class VllmConnectorLeader(VllmSide):
    """kvbm's scheduler-side connector for vLLM."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        self._leader: Leader | None = None
        # Rank 0's G4 block fingerprint, as the workers reported it.
        self._g4_fingerprint = ""
        # Requests answered with an asynchronous load (request id →
        # num_computed_tokens at matching), and loads promised by
        # update_state_after_alloc that no plan carries yet (request id →
        # their G1 blocks).
        self._async_matches: dict[str, int] = {}
        self._promised_loads: dict[str, list[int]] = {}
        self._requests: dict[str, Any] = {}
        self._sent_tokens: dict[str, int] = {}
        self._sent_end: dict[str, int] = {}  # request → its full blocks computed, as of the last step sent
        # Tokens the leader got at matching (request id → how many): the
        # request's next new or resumed row carries only those after them.
        self._matched_tokens: dict[str, int] = {}
        self._salts: dict[str, int] = {}
        self._bypassed: set[str] = set()  # multimodal / embedding prompts
        self._loaded: list[str] = []
        self._invalid_blocks: list[int] = []
        self._seq = 0
        # vLLM's KV event stream (take_events): kvbm's G2/G3 events under
        # vLLM's block hashes; None unless vLLM publishes KV events.
        self._tier_events: TierEvents | None = None
        # Connector stats (get_kv_connector_stats): figures since the last
        # report, tokens each request looked up (request id → tokens past
        # vLLM's prefix cache, from matching), and the leader's figures at
        # the last report.
        self._stats = KvbmConnectorStats(data={})
        self._lookup: dict[str, int] = {}
        self._info_reported: dict[str, float] = {}
        # Several KV cache groups (_groups.py): the groups and the one the Go
        # leader plans with. Each row carries every group's new blocks and
        # the Go leader builds the plan's group rows; the blocks allocated
        # for a load go with the next step (request id → every group's blocks).
        self._groups: GroupLayout | None = None
        self._primary = 0
        self._alloc_groups: dict[str, list[list[int]]] = {}
        self._prefer_recompute_on_load_failure()
        self._init_scheduler()

    def shutdown(self) -> None:
        # One handle: closing it stops the leader's background loop (the
        # operation in flight is cancelled and failed), then its side channel.
        if self._leader is not None:
            try:
                self._leader.close()
            except Exception:  # pragma: no cover
                log.exception("kvbm: error while shutting down")
        self._leader = None

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

        groups, why = kv_groups(self._kv_cache_config, self._block_size)
        if groups is None:
            self._disable(str(why))
            return
        if groups.with_rows:
            self._groups, self._primary = groups, groups.primary
        if groups.num_groups > 1:
            log.info("kvbm: %d KV cache groups: %s; a kvbm block holds every layer of one position, "
                     "planned with group %d's blocks", groups.num_groups, groups.describe(), groups.primary)
        num_layers = groups.num_layers
        bytes_per_block = groups.page_bytes * num_layers
        _, tp_size = _tp(self._vllm_config)
        kv_group_opts: KVGroupsOptions | None = None
        if self._groups is not None:
            kv_group_opts = {"primary": groups.primary, "null_block": NULL_BLOCK_ID,
                             "windows": list(groups.windows) or [(0, 0)] * groups.num_groups}
            if groups.has_state:
                kv_group_opts["state"] = list(groups.state)
        consolidator: ConsolidatorOptions | None = None
        if should_enable_consolidator(self._vllm_config):
            engine_ep, out_bind, _ = get_consolidator_endpoints(self._vllm_config)
            consolidator = {"engine": "vllm", "engine_endpoint": engine_ep, "zmq_bind": out_bind}
        leader = Leader(
            block_size=self._block_size,
            bytes_per_block=bytes_per_block,
            num_workers=tp_size,
            consolidator=consolidator,
            g4_async=True,  # vLLM asks again when told "not ready yet" (None)
            # vLLM computes the last token of a prompt cached whole; not with a
            # windowed group (_groups.GroupLayout.full_hit_ok).
            load_full_hit=groups.full_hit_ok,
            side_channel={"secret": _side_channel_secret(self._vllm_config)} if tp_size > 1 else None,
            tier_events=events_enabled(self._vllm_config),
            kv_groups=kv_group_opts,
        )
        if tp_size > 1:
            bytes_per_block = self._wait_side_channel(leader)
        self._leader = leader
        info = leader.info()
        if events_enabled(self._vllm_config):
            hash_bs = int(getattr(self._kv_cache_config, "hash_block_size", 0) or self._block_size)
            # Blocks sent to the leader but not stored yet: a few times what the tiers hold.
            self._tier_events = TierEvents(self._block_size, hash_bs,
                                           4 * (info["host_blocks"] + info["disk_blocks"]) + 4096)
        log.info(
            "kvbm leader ready (pid %d): block_size=%d layers=%d bytes_per_block=%d tp=%d host_blocks=%d "
            "disk_blocks=%d consolidator=%s metrics=%s",
            os.getpid(), self._block_size, num_layers, bytes_per_block, tp_size, info["host_blocks"],
            info["disk_blocks"], bool(consolidator), info.get("metrics_addr", "off"),
        )

    @staticmethod
    def _wait_side_channel(leader: Leader) -> int:
        """TP > 1: wait until every rank's worker reported and allocated
        (vLLM registers the workers' KV caches before it creates the
        scheduler). Returns one rank's bytes per block.

        Errors propagate: a taken port (raised by Leader itself) or a rank
        that never answers is a configuration error, and the message names
        the variable to change (DYN_KVBM_LEADER_ZMQ_PUB_PORT / _ACK_PORT,
        DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)."""
        try:
            leader.wait_ready()
        except BaseException:
            leader.close()
            raise
        sc = leader.info()["side_channel"]
        log.info("kvbm side channel ready: transport %s, pub port %s, ack port %s, bytes_per_block=%d per rank",
                 sc["transport"], sc["pub_port"], sc["ack_port"], sc["bytes_per_block"])
        return int(sc["bytes_per_block"])

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
        self._matched_tokens[request.request_id] = len(tokens)  # the leader keeps them, whatever it answered
        if got == self._leader.PENDING:
            # A G4 lookup for this request is running: vLLM keeps the request
            # waiting and asks again on a later step.
            self._async_matches.pop(request.request_id, None)
            return None, False
        self._lookup[request.request_id] = max(0, len(tokens) - int(num_computed_tokens))
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
        block_ids = list(blocks.get_block_ids()[self._primary])
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
        self._stats.add("lookup_tokens", self._lookup.pop(rid, 0))
        if num_external_tokens > 0:
            all_ids = blocks.get_block_ids()
            if self._groups is not None:
                # The load's rows come from here: a request waiting for its
                # load is not in the scheduler output.
                self._alloc_groups[rid] = [list(ids) for ids in all_ids]
            self._leader.update_after_alloc(rid, all_ids[self._primary], num_external_tokens)
            bs = self._block_size
            for tier, n in zip(("host", "disk", "object"), self._leader.load_sources(rid, num_external_tokens)):
                self._stats.add("loaded_tokens", n, tier)
                self._stats.add("hit_blocks", -(-n // bs), tier)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's per-source cache hit counts (asked right after
        update_state_after_alloc): the tokens of the planned load by the tier
        each block comes from, host (G2) and disk (G3); G4, an object store
        shared by a fleet, has no source of its own in vLLM and counts as
        external_unspecified, as do tokens kvbm cannot place."""
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
        except ImportError:  # a vLLM without per-source hit metrics never asks
            return {}
        if num_external_tokens <= 0:
            return {}
        host, disk = self._load_sources(request.request_id, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: disk,
               CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens - host - disk}
        return {k: v for k, v in out.items() if v > 0}

    @guarded((0, 0))
    def _load_sources(self, rid: str, num_tokens: int) -> tuple[int, int]:
        """(host, disk) tokens of the request's planned load; (0, 0) without a leader."""
        if self._leader is None:
            return 0, 0
        host, disk, _ = self._leader.load_sources(rid, num_tokens)
        return host, disk

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
        if self._quiet(self._leader, scheduler_output, num_sched):
            # Nothing for the leader (goext/leader/quiet.go): no call
            # into Go, and the workers bind nothing.
            for rid in scheduler_output.finished_req_ids or ():
                self._forget(rid)
            return DynamoConnectorMetadata()
        # Rows carry no priority: vLLM's request priority orders scheduling,
        # not retention, so the offload filter never applies under vLLM.
        updates: list[StepUpdate] = []
        for nr in scheduler_output.scheduled_new_reqs:
            rid = nr.req_id
            if rid in self._bypassed:
                continue
            req = self._requests.get(rid)
            tokens = req.all_token_ids if req is not None else list(nr.prompt_token_ids or [])
            self._sent_tokens[rid] = len(tokens)
            self._sent_end[rid] = _computed_blocks(len(tokens), nr.num_computed_tokens, num_sched.get(rid, 0),
                                                   self._leader.block_size)
            known = self._known_tokens(rid, len(tokens))
            updates.append(StepUpdate(
                req_id=rid, new_tokens=list(tokens[known:]),
                new_block_ids=list(nr.block_ids[self._primary]) if nr.block_ids else [],
                num_computed=int(nr.num_computed_tokens), num_scheduled=int(num_sched.get(rid, 0)), priority=None,
                salt=self._salt(req) if req is not None else _native.salt_hash(), resumed=False,
                known_tokens=known, groups=self._row_groups(nr.block_ids, True),
            ))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            is_resumed = rid in resumed
            all_tokens = req.all_token_ids
            known = 0
            if is_resumed:
                known = self._known_tokens(rid, len(all_tokens))
                tokens = list(all_tokens[known:])
            else:
                tokens = list(all_tokens[self._sent_tokens.get(rid, 0):])
            self._sent_tokens[rid] = len(all_tokens)
            self._sent_end[rid] = _computed_blocks(len(all_tokens), cached.num_computed_tokens[i],
                                                  num_sched.get(rid, 0), self._leader.block_size)
            updates.append(StepUpdate(
                req_id=rid, new_tokens=tokens,
                new_block_ids=list(new_blocks[self._primary]) if new_blocks else [],
                num_computed=int(cached.num_computed_tokens[i]), num_scheduled=int(num_sched.get(rid, 0)),
                priority=None, salt=self._salt(req), resumed=is_resumed, known_tokens=known,
                groups=self._row_groups(new_blocks, is_resumed),
            ))
        if self._tier_events is not None:
            for u in updates:
                req = self._requests.get(u.req_id)
                if req is not None:
                    self._tier_events.note_request(req, u.salt, u.resumed)
        loaded, self._loaded = self._loaded, []
        invalid, self._invalid_blocks = self._invalid_blocks, []
        # TP > 1: step also wakes the leader's background loop, which sends
        # G2→G3 moves to every rank over the side channel (off this thread).
        alloc, self._alloc_groups = self._alloc_groups, {}
        plan = self._leader.step(updates, loaded, invalid, alloc)
        for rid in scheduler_output.finished_req_ids or ():
            self._forget(rid)
        self._seq += 1
        # The leader emits every load it planned in the next step: the loads
        # promised so far are in this plan, and the workers own them now.
        self._promised_loads.clear()
        return DynamoConnectorMetadata(plan=plan, seq=self._seq)

    def _quiet(self, leader: Leader, scheduler_output: Any, num_sched: Mapping[str, int]) -> bool:
        """A step the leader has nothing to do in: no request is new or
        resumed, none is given a block or completes one (its full blocks
        computed stay those of the last step sent), kvbm has nothing to report (finished or failed
        loads, allocations of a load) and the leader waits for no step
        (Leader.step_needed: moves, drops, loads or uploads it queued). Most
        decode steps are. The tokens of the steps left out reach the leader
        with the next step it gets: a row's new tokens are whatever it was
        not sent."""
        if self._loaded or self._invalid_blocks or self._alloc_groups or self._promised_loads:
            return False
        if any(nr.req_id not in self._bypassed for nr in scheduler_output.scheduled_new_reqs):
            return False
        cached = scheduler_output.scheduled_cached_reqs
        if getattr(cached, "resumed_req_ids", None):
            return False
        for i, rid in enumerate(cached.req_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks and any(new_blocks):
                return False
            # The blocks whose tokens are known and computed by the end of
            # the step, as the leader's save planning counts them: the same
            # as at the last step it was sent (with speculative decoding
            # the drafts are scheduled but not yet tokens).
            end = _computed_blocks(len(req.all_token_ids), cached.num_computed_tokens[i], num_sched.get(rid, 0),
                                   leader.block_size)
            if end != self._sent_end.get(rid):
                return False
        return not leader.step_needed()

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
        for rep in getattr(meta, "g4_reports", None) or ():
            self._leader.g4_report(rep)
        for t in getattr(meta, "transfer_timings", None) or ():
            self._leader.transfer_timings(t)  # the load-cost model (workers in other processes)
        # Several KV cache groups: failed loads reach vLLM per request, their
        # blocks come here.
        self._invalid_blocks.extend(int(b) for b in getattr(meta, "load_errors", None) or ())

    @guarded((False, None))
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._lookup.pop(request.request_id, None)  # matched but never allocated (aborted while waiting)
        if self._leader is None:
            return False, None
        pending = self._leader.request_finished(request.request_id)
        return pending, None

    def _forget(self, rid: str) -> None:
        self._async_matches.pop(rid, None)
        self._requests.pop(rid, None)
        self._sent_tokens.pop(rid, None)
        self._sent_end.pop(rid, None)
        self._matched_tokens.pop(rid, None)
        self._salts.pop(rid, None)
        self._bypassed.discard(rid)
        self._lookup.pop(rid, None)
        if self._tier_events is not None:
            self._tier_events.forget_request(rid)
        self._alloc_groups.pop(rid, None)

    def _known_tokens(self, rid: str, num_tokens: int) -> int:
        """How many of the request's first tokens the leader has from
        matching (its new or resumed row leaves them out); 0 when it was not
        matched since (scheduled without asking, or a fresh leader)."""
        known = self._matched_tokens.pop(rid, 0)
        return known if known <= num_tokens else 0

    def _row_groups(self, per_group: Any, replace: bool) -> tuple[bool, list[list[int]]] | None:
        """A row's blocks of every KV cache group (with group rows only)."""
        if self._groups is None or not per_group:
            return None
        return replace, [list(ids) for ids in per_group]

    @guarded(lambda self: [])
    def take_events(self) -> list[Any]:
        """kvbm's G2/G3 stores and removals since the last call, as vLLM
        events (kvbm.vllm_integration.connector._events); none unless vLLM
        publishes KV events."""
        if self._leader is None or self._tier_events is None:
            return []
        return self._tier_events.take(self._leader)

    def get_kv_connector_stats(self) -> KvbmConnectorStats | None:
        """The scheduler's figures since the last call: tokens looked up,
        tokens and blocks planned to load per tier, G4 lookups; and the
        leader's gauges (tier use, degraded, G4 queue and breakers) when
        they changed. None when there is nothing to report."""
        stats, self._stats = self._stats, KvbmConnectorStats(data={})
        self._leader_figures(stats)
        return None if stats.is_empty() else stats

    @guarded(None)
    def _leader_figures(self, stats: KvbmConnectorStats) -> None:
        if self._leader is None:
            return
        # Called every step: the figures of the leader's last step, read
        # without a call into Go (kvbm_leader_info only before any step).
        info: Any = self._leader.figures() or self._leader.info()
        g4: dict[str, Any] = dict(info.get("g4") or {})
        now = {"host_blocks_registered": info["host_blocks_used"], "disk_blocks_registered": info["disk_blocks_used"],
               "degraded": int(bool(info["degraded"]))}
        if g4:
            now["g4_queue_depth"] = g4["queue_depth"]
            now["g4_breakers_open"] = g4["breakers_open"]
        for name, v in now.items():
            if self._info_reported.get(name) != v:
                stats.set_gauge(name, v)
                self._info_reported[name] = v
        totals = {"g4_lookup_hits": g4.get("lookup_hits", 0), "g4_lookup_misses": g4.get("lookup_misses", 0)}
        if self._tier_events is not None:
            totals["kv_events_unmapped"] = self._tier_events.unmapped
            totals["kv_events_dropped"] = self._tier_events.dropped
        for name, v in totals.items():
            stats.add(name, v - self._info_reported.get(name, 0))
            self._info_reported[name] = v

    @guarded(False)
    def reset_cache(self) -> bool:
        if self._leader is not None:
            self._leader.reset()
        return True

    def get_finished_count(self) -> int | None:
        return None

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """vLLM hands over what every worker's
        get_handshake_metadata returned (tp rank → metadata) once the KV
        caches are registered, before the first step, whether the workers run
        in this process or others: rank 0's G4 fingerprint (G4 lookups
        start), and the disk tier blocks every rank's persistent tier
        recovered."""
        if self._leader is None or not metadata:
            return
        fp = getattr(metadata.get(0), "g4_fingerprint", "")
        if fp and fp != self._g4_fingerprint:
            # Rank 0's worker names its G4 objects by this: lookups start.
            try:
                self._leader.set_g4_fingerprint(fp)
                self._g4_fingerprint = fp
            except Exception as e:  # noqa: BLE001 - kvbm serves without G4 lookups
                log.warning("kvbm: rank 0's G4 fingerprint not taken (no G4 lookups): %s", e)
        _, tp_size = _tp(self._vllm_config)
        recs = [getattr(metadata.get(r), "recovered", b"") for r in range(tp_size)]
        if not all(recs):
            return  # no persistent disk tier (or a rank without one)
        try:
            n = self._leader.restore_disk(recs)
            log.info("kvbm: %d disk tier blocks recovered from the persistent tier of %d rank(s)", n, tp_size)
        except Exception as e:  # noqa: BLE001 - a cache that starts empty still serves
            log.warning("kvbm: persistent disk tier not restored (starting with an empty disk tier index): %s", e)


def _computed_blocks(num_tokens: int, num_computed: int, num_scheduled: int, block_size: int) -> int:
    """Full blocks of a request's tokens computed by the end of a step, as
    the leader's save planning counts them (goext/leader/step.go planSaves)."""
    return min(int(num_computed) + int(num_scheduled), num_tokens) // block_size
