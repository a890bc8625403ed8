"""Typed Python handles over the native leader and worker (kvbm._native).

Engine adapters (vLLM, TensorRT-LLM) convert engine objects into the plain
values these take; all logic lives in Go.
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from ctypes import POINTER, byref, c_char_p, c_int32, c_int64, c_uint8, c_uint32, c_uint64
from typing import TYPE_CHECKING, NamedTuple, NotRequired, TypedDict

import msgpack

from kvbm import _native
from kvbm._errors import KvbmIOError

if TYPE_CHECKING:
    from ctypes import Array
    from typing import Unpack

    from kvbm._native import Tokens

log = logging.getLogger("kvbm")


class ConsolidatorOptions(TypedDict, total=False):
    """Options of a KV event consolidator (capi/consolidator.go
    consolidatorOptions): :class:`Consolidator` keywords, ``Leader(consolidator=)``."""

    engine: str  # "vllm", "trtllm" or "sglang"
    engine_endpoint: str  # engine KV events (ZMQ SUB connects here); "" = none
    zmq_bind: str  # consolidated output (ZMQ PUB binds here); "" = none
    nats: bool  # publish RouterEvents on NATS (NATS_SERVER or nats_url)
    nats_url: str
    namespace: str
    component: str
    legacy_subject: bool
    worker_id: int
    buffer_limit: int
    mode: str  # "dedup" or "passthrough"; unset: DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE


class LeaderConsolidatorInfo(TypedDict):
    """The counters of a leader's own consolidator (``LeaderInfo["consolidator"]``)."""

    events_in: int
    deduplicated: int
    zmq_events: int
    nats_events: int
    nats_dropped: int
    tracked: int
    zmq_endpoint: str


class _LeaderInfoRequired(TypedDict):
    host_blocks: int
    disk_blocks: int
    disk_only: bool
    host_hit_rate: float
    disk_hit_rate: float
    host_hit_blocks: int
    disk_hit_blocks: int
    queried_blocks: int
    degraded: bool
    dead_ranks: list[int]
    background_inflight: int
    host_blocks_used: int
    disk_blocks_used: int


class LeaderG4Info(TypedDict):
    """G4 (object storage) counters (``LeaderInfo["g4"]``, docs/g4.md): this
    process's, plus those workers in other processes last reported."""

    offload_blocks_h2obj: int
    onboard_blocks_obj2h: int
    lookup_hits: int
    lookup_misses: int
    already_stored: int
    upload_drops: int
    errors: int
    corrupt: int  # objects proven damaged and deleted
    verify_failures: int  # downloads that did not verify (damaged, forged, another key)
    queue_depth: int
    breakers_open: int


class KVGroupsOptions(TypedDict):
    """The engine's KV cache groups (``Leader(kv_groups=...)``): the group
    the leader plans with, per group (sliding window, extra retained tokens)
    or (0, chunk size) or (0, 0) for full attention, the engine's null
    block id, and which groups keep recurrent state (optional)."""

    primary: int
    windows: list[tuple[int, int]]
    null_block: int
    state: NotRequired[list[bool]]


class LeaderSideChannelOptions(TypedDict, total=False):
    """``Leader(side_channel=)``: the leader⇄worker side channel for
    tensor-parallel ranks in other processes (capi/sidechannel.go)."""

    transport: str  # "auto" (in-process for one worker), "tcp" or "inproc"
    ping_interval_ms: int  # 0: 500 ms
    suspect_after_ms: int  # 0: DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS
    secret: str  # the engine instance's id; DYN_KVBM_LEADER_WORKER_SECRET wins
    broadcast_timeout_ms: int  # one background operation; 0: 60 s


class WorkerSideChannelOptions(TypedDict, total=False):
    """``Worker(side_channel=)``: connect this rank to the leader's side channel."""

    transport: str
    secret: str


class LeaderSideChannelInfo(TypedDict):
    """``LeaderInfo["side_channel"]``: the channel's state and the leader's
    background operations over it."""

    transport: str  # "tcp" or "inproc"
    pub_port: int
    ack_port: int
    healthy: bool
    dead_ranks: list[int]  # processes gone, for good
    suspect_ranks: list[int]  # silent; re-admitted when they answer again
    forged_messages: int  # messages rejected: wrong secret or forged
    num_device_blocks: int  # as every rank reported in the handshake
    bytes_per_block: int  # one rank's share of a block
    committed: int  # background operations every rank acked (their disk blocks registered)
    failed: int  # background operations failed (blocks freed, moves retried)
    last_error: str  # "" if none
    unauthenticated_peers_dropped: int  # ack-port connections closed: too many bytes before authenticating


class LeaderInfo(_LeaderInfoRequired, total=False):
    """:meth:`Leader.info`: tier sizes and use, hit rates, degraded state;
    ``metrics_addr`` when the metrics endpoint runs, ``consolidator`` when the
    leader runs one, ``g4`` with the object-storage tier, ``side_channel``
    with one."""

    metrics_addr: str
    consolidator: LeaderConsolidatorInfo
    g4: LeaderG4Info
    side_channel: LeaderSideChannelInfo


class WorkerSideChannelInfo(TypedDict):
    """``WorkerInfo["side_channel"]``: this rank's end of the side channel."""

    ready: bool  # the leader's handshake completed for this rank
    stopped: bool
    error: str  # "" while healthy
    forged_messages: int
    reconnects: int  # subscriptions redialed after the leader's PUB dropped or went silent
    unauthenticated_peers_dropped: int  # subscriptions closed: too many bytes before the leader authenticated


class _WorkerInfoRequired(TypedDict):

    disk_degraded: bool
    g1: str  # "host", or the device copier (e.g. "cuda:0 staged")
    bytes_per_block: int
    host_blocks: int
    disk_blocks: int
    disk_path: str
    layout: str
    num_layers: int
    fingerprint: str
    disk_persistent: bool  # DYN_KVBM_DISK_PERSIST in effect (docs/persistent-g3.md)
    disk_recovered_blocks: int
    g4: bool  # DYN_KVBM_OBJECT_ENABLED: this rank uploads to / downloads from G4


class WorkerInfo(_WorkerInfoRequired, total=False):
    """:meth:`Worker.info`: the rank's layout and tier sizes; ``side_channel`` with one."""

    side_channel: WorkerSideChannelInfo


class DirectionStats(TypedDict):
    """One transfer direction's totals on a worker (:meth:`Worker.stats`)."""

    blocks: int  # blocks copied successfully
    failed: int  # block copies that failed
    bytes: int  # this rank's bytes of the blocks copied
    seconds: float  # time spent in the batches, summed
    batches: int  # batches timed


class WorkerStats(TypedDict):
    """:meth:`Worker.stats`: transfer totals per direction ("g1_to_g2",
    "g2_to_g1", "g2_to_g3", "g3_to_g1", "g1_to_g3", "g4_to_g2", "g2_to_g4")
    since the worker was created."""

    directions: dict[str, DirectionStats]
    bytes_per_block: int


class TierEvent(NamedTuple):
    """A G2/G3/G4 store or removal (:meth:`Leader.take_events`)."""

    removed: bool
    tier: int  # TIER_HOST (G2), TIER_DISK (G3) or TIER_OBJECT (G4)
    seq_hash: int  # kvbm's sequence hash of the block
    parent: int | None  # the parent's sequence hash (G2/G3 stores; None for a first block)
    tokens: list[int]  # the block's tokens (G2/G3 stores: G4's registry knows hashes only)


# TierEvent.tier values (goext/events Holder).
TIER_HOST = 2
TIER_DISK = 3
TIER_OBJECT = 4  # the blocks the leader's G4 registry believes the bucket holds


class ConsolidatorStats(TypedDict):
    """:meth:`Consolidator.stats`: counters since start."""

    batches_in: int
    events_in: int
    invalid: int
    deduplicated: int
    unknown_removes: int
    not_forwarded: int  # kvbm tier events not forwarded in passthrough mode
    tracked: int
    zmq_messages: int
    zmq_events: int
    nats_events: int
    nats_dropped: int
    nats_buffered: int
    zmq_endpoint: str


_P = POINTER
_ERR = _P(c_char_p)
_native.register_signatures(
    {
        "kvbm_leader_new": (ctypes.c_int, [c_char_p, _P(c_uint64), _ERR]),
        "kvbm_leader_free": (None, [c_uint64]),
        "kvbm_leader_info": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_leader_match": (
            ctypes.c_int,
            [c_uint64, c_char_p, _P(c_uint32), c_int64, c_uint64, c_int64, _P(c_int64), _P(c_int32), _ERR],
        ),
        "kvbm_leader_update_after_alloc": (ctypes.c_int, [c_uint64, c_char_p, _P(c_int64), c_int64, c_int64, _ERR]),
        "kvbm_leader_load_sources": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _P(c_int64), _P(c_int64), _P(c_int64),
                                                    _ERR]),
        "kvbm_leader_step": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_leader_request_finished": (ctypes.c_int, [c_uint64, c_char_p, _P(c_int32), _ERR]),
        "kvbm_leader_reset": (ctypes.c_int, [c_uint64, _ERR]),
        "kvbm_leader_wait_ready": (ctypes.c_int, [c_uint64, c_int64, _P(c_int32), _ERR]),
        "kvbm_leader_set_g4_fingerprint": (ctypes.c_int, [c_uint64, c_char_p, _ERR]),
        "kvbm_leader_g4_report": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _ERR]),
        "kvbm_worker_g4_report": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_stats": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_figures_addr": (ctypes.c_int, [c_uint64, _P(c_uint64), _P(c_int64), _ERR]),
        "kvbm_leader_figures_addr": (ctypes.c_int, [c_uint64, _P(c_uint64), _P(c_int64), _ERR]),
        "kvbm_leader_transfer_timings": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _ERR]),
        "kvbm_worker_transfer_timings": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_leader_take_events": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_new": (ctypes.c_int, [c_char_p, _P(c_uint64), _ERR]),
        "kvbm_worker_free": (None, [c_uint64]),
        "kvbm_worker_info": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_bind": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_start_load": (ctypes.c_int, [c_uint64, _ERR]),
        "kvbm_worker_wait_loads": (ctypes.c_int, [c_uint64, _ERR]),
        "kvbm_worker_wait_for_save": (ctypes.c_int, [c_uint64, _ERR]),
        "kvbm_worker_finished": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_worker_set_cuda_stream": (ctypes.c_int, [c_uint64, c_uint64, _ERR]),  # CUDA build only
        "kvbm_worker_recovered": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_leader_restore_disk": (ctypes.c_int, [c_uint64, c_char_p, c_int64, _P(c_int64), _ERR]),
        "kvbm_consolidator_new": (ctypes.c_int, [c_char_p, _P(c_uint64), _ERR]),
        "kvbm_consolidator_stats": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_consolidator_free": (None, [c_uint64]),
    }
)


def _buffer_call(name: str, *args: object) -> bytes:
    buf = _P(c_uint8)()
    n = c_int64()
    _native.call(name, *args, byref(buf), byref(n))
    return _native.take_buffer(buf, n)


def _figure_slots(export: str, h: int) -> Array[c_int64]:
    """A handle's figure slots (capi/figures.go): int64 words Go keeps
    current, read here without a call. Go never frees them, so a read after
    the handle closed sees the last figures."""
    addr, n = c_uint64(), c_int64()
    _native.call(export, h, byref(addr), byref(n))
    return (c_int64 * n.value).from_address(addr.value)


class LeaderFigures(TypedDict):
    """The leader's figures as of its last step (or :meth:`Leader.info`)."""

    host_blocks_used: int
    disk_blocks_used: int
    degraded: bool
    g4: LeaderG4Figures | None


class LeaderG4Figures(TypedDict):
    queue_depth: int
    breakers_open: int
    lookup_hits: int
    lookup_misses: int


def _int64_array(values: Sequence[int]) -> tuple[Array[c_int64], int]:
    n = len(values)
    return (c_int64 * max(n, 1))(*values), n


# kvbm_leader_wait_ready's slice: Python runs signal handlers (Ctrl-C) only
# between native calls, so a long handshake is waited for in slices.
_WAIT_SLICE_S = 1.0


class Leader(_native.Handle):
    """The logical block manager of one engine instance (scheduler process).

    With ``side_channel`` (tensor-parallel ranks in other processes) the
    constructor binds the side channel (a taken port raises
    :class:`kvbm.KvbmIOError` naming ``DYN_KVBM_LEADER_ZMQ_PUB_PORT`` /
    ``_ACK_PORT``) and :meth:`wait_ready` completes the handshake: every rank
    reports its shard geometry, the leader sizes G2/G3 from it
    (``bytes_per_block`` is the ranks'), every rank allocates. Until then the
    other methods raise :class:`kvbm.KvbmStateError`. The leader then sends its
    background operations (G2->G3 moves) to every rank itself, after each
    :meth:`step`; a disk block becomes matchable once every rank wrote its
    shard, and dead ranks put it in degraded mode (``info()["degraded"]``).
    """

    _free = "kvbm_leader_free"

    def __init__(self, *, block_size: int, bytes_per_block: int = 0, num_workers: int = 1, worker_id: int = 0,
                 consolidator: ConsolidatorOptions | None = None, background: bool = False,
                 g4_async: bool = False, side_channel: LeaderSideChannelOptions | None = None,
                 load_full_hit: bool = False, tier_events: bool = False,
                 kv_groups: KVGroupsOptions | None = None, fingerprint: str = "") -> None:
        # request id → its tokens converted for kvbm_leader_match (see match).
        self._token_cache: dict[str, _native.TokenArray] = {}
        opts: dict[str, object] = {
            "block_size": int(block_size),
            "bytes_per_block": int(bytes_per_block),
            "num_workers": int(num_workers),
            "worker_id": int(worker_id),
        }
        if background:
            # G2->G3 moves leave the step plans (implied by side_channel).
            opts["background"] = True
        if side_channel is not None:
            opts["side_channel"] = dict(side_channel)
        if consolidator:
            opts["consolidator"] = consolidator
        if g4_async:
            # The engine asks again when match answers PENDING (a G4 lookup runs).
            opts["g4_async"] = True
        if load_full_hit:
            # A prompt cached whole loads every block; match reports one token
            # short of it, so the engine computes only the last token.
            opts["load_full_hit"] = True
        if tier_events:
            # Keep G2/G3/G4 store and removal events for take_events.
            opts["tier_events"] = True
        if kv_groups is not None:
            # The plans carry group rows, built in Go from each row's groups.
            opts["kv_groups"] = dict(kv_groups)
        if fingerprint:
            # Rank 0's block fingerprint (its worker's info()["fingerprint"]):
            # G4 lookups from the start (else: set_g4_fingerprint later).
            opts["fingerprint"] = fingerprint
        opts["env"] = _native.env_snapshot()
        h = c_uint64()
        _native.call("kvbm_leader_new", json.dumps(opts).encode(), byref(h))
        self._h = h.value
        self.block_size = int(block_size)
        self._figs = _figure_slots("kvbm_leader_figures_addr", self._h)

    def figures(self) -> LeaderFigures | None:
        """The figures an engine reports every step (tier use, degraded, G4
        queue, breakers and lookups), as of the leader's start, its last
        :meth:`step` or :meth:`info`, read without calling into Go; None
        before the leader started (a side channel's handshake pending)."""
        f = self._figs
        if f[0] == 0:  # capi/figures.go: publications, then the figures in this order
            return None
        g4: LeaderG4Figures | None = None
        if f[4]:
            g4 = {"queue_depth": f[5], "breakers_open": f[6], "lookup_hits": f[7], "lookup_misses": f[8]}
        return {"host_blocks_used": f[1], "disk_blocks_used": f[2], "degraded": bool(f[3]), "g4": g4}

    def step_needed(self) -> bool:
        """Whether the leader has work for the next step even if no request
        in it is new, resumed, allocates a block or completes one: G2→G3
        moves, drops, loads or uploads it queued, a save to retry (Go's
        leader.StepNeeded, read from memory Go keeps current, without a
        call). True before the leader started. An engine adapter may leave
        out a step that needs none (the next step's rows carry the tokens in
        between)."""
        f = self._figs
        return len(f) <= 9 or f[0] == 0 or bool(f[9])

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the side-channel handshake completed and the leader
        is created (releases the GIL; returns at once without a side channel).

        Bounded by ``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS`` (the error
        names the ranks that never answered) and ``timeout_s`` (KvbmIOError;
        call again to keep waiting)."""
        # Waits in slices of at most a second, so Ctrl-C (or any signal
        # handler) interrupts it within a second.
        end = None if timeout_s is None else time.monotonic() + timeout_s
        ready = c_int32()
        while True:
            left = _WAIT_SLICE_S if end is None else min(_WAIT_SLICE_S, end - time.monotonic())
            _native.call("kvbm_leader_wait_ready", self._h, max(1, int(max(left, 0.001) * 1000)), byref(ready))
            if ready.value:
                return
            if end is not None and time.monotonic() >= end:
                raise KvbmIOError(
                    f"kvbm leader: leader/worker handshake not complete within timeout_s={timeout_s}; it goes "
                    f"on until DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS (call wait_ready() again to keep waiting)")

    def info(self) -> LeaderInfo:
        info: LeaderInfo = json.loads(_buffer_call("kvbm_leader_info", self._h))
        return info

    # Requests whose converted tokens are kept (between a first match and
    # request_finished). A bound, not a working limit: an engine finishes every
    # request it matched; past it the oldest entry is dropped (only its next
    # match converts again).
    MAX_TOKEN_CACHE = 4096

    # match's answer while a G4 lookup for the request runs (only for a leader
    # created with g4_async): ask again on a later step.
    PENDING = -1

    def match(self, req_id: str, tokens: Tokens, salt_hash: int, num_computed: int) -> tuple[int, bool]:
        """Engine's get_num_new_matched_tokens. ``tokens``: a list (converted
        once per request and kept until :meth:`request_finished`; later calls
        convert only appended tokens), a numpy array or a uint32 buffer (used
        in place). Returns (PENDING, False) while a G4 lookup runs."""
        cache = self._token_cache
        buf = cache.get(req_id)
        if buf is None:
            if len(cache) >= self.MAX_TOKEN_CACHE:
                del cache[next(iter(cache))]
            buf = cache[req_id] = _native.TokenArray()
        ptr, n, _keep = buf.view(tokens)
        got = c_int64()
        is_async = c_int32()
        _native.call("kvbm_leader_match", self._h, req_id.encode(), ptr, n, salt_hash, num_computed,
                     byref(got), byref(is_async))
        return got.value, bool(is_async.value)

    def set_g4_fingerprint(self, fingerprint: str) -> None:
        """Rank 0's block fingerprint (its worker's ``info()["fingerprint"]``):
        the leader looks G4 blocks up under it. Ignored without a G4 tier."""
        _native.call("kvbm_leader_set_g4_fingerprint", self._h, fingerprint.encode())

    def g4_report(self, report: bytes) -> None:
        """A worker's :meth:`Worker.g4_report` (blocks it stored in G4, its counters)."""
        _native.call("kvbm_leader_g4_report", self._h, report, len(report))

    def transfer_timings(self, timings: bytes) -> None:
        """A worker's :meth:`Worker.transfer_timings` (its timed load batches)
        for the load-cost model; a worker of this process is heard directly."""
        _native.call("kvbm_leader_transfer_timings", self._h, timings, len(timings))

    def update_after_alloc(self, req_id: str, block_ids: Iterable[int], num_external_tokens: int) -> None:
        arr, n = _int64_array(list(block_ids))
        _native.call("kvbm_leader_update_after_alloc", self._h, req_id.encode(), arr, n, int(num_external_tokens))

    def load_sources(self, req_id: str, num_tokens: int) -> tuple[int, int, int]:
        """How the first ``num_tokens`` tokens of the request's planned load
        (after :meth:`update_after_alloc`, before the next :meth:`step`) split
        by tier: (host, disk, remote) tokens, from G2, G3 and G4."""
        host, disk, remote = c_int64(), c_int64(), c_int64()
        _native.call("kvbm_leader_load_sources", self._h, req_id.encode(), int(num_tokens), byref(host),
                     byref(disk), byref(remote))
        return host.value, disk.value, remote.value

    def step(self, updates: Sequence[Sequence[object]], loaded: Iterable[str] = (),
             load_errors: Iterable[int] = (), alloc_groups: Mapping[str, Sequence[Sequence[int]]] | None = None,
             ) -> bytes:
        """updates: one row per request, ``kvbm._adapter_common.StepUpdate``
        (req_id, new_tokens, new_block_ids, num_computed, num_scheduled,
        priority, salt, resumed[, known_tokens, groups]); any list or tuple in
        that order encodes to the same msgpack array.

        priority: None (no priorities: the offload filter does not apply), a
        list with the priority of each new block id, or one int for all of them.
        known_tokens: new_tokens follow the first known_tokens tokens the
        leader got from :meth:`match` (each token crosses once).
        groups (a leader created with ``kv_groups``): None, or (replace, the
        new block ids of every KV cache group).
        loaded: request ids whose loads completed; load_errors: G1 blocks
        whose load failed; alloc_groups: request id -> every group's blocks
        allocated for its load (a leader created with ``kv_groups``).
        """
        parts: list[object] = [updates, list(loaded), list(load_errors)]
        if alloc_groups:
            parts.append({r: [list(ids) for ids in g] for r, g in alloc_groups.items()})
        payload: bytes = msgpack.packb(parts, use_bin_type=True)
        return _buffer_call("kvbm_leader_step", self._h, payload, len(payload))

    def request_finished(self, req_id: str) -> bool:
        self._token_cache.pop(req_id, None)
        pending = c_int32()
        _native.call("kvbm_leader_request_finished", self._h, req_id.encode(), byref(pending))
        return bool(pending.value)

    def reset(self) -> None:
        _native.call("kvbm_leader_reset", self._h)

    def close(self) -> None:
        self._token_cache.clear()
        super().close()

    def take_events(self) -> tuple[list[TierEvent], int]:
        """The G2/G3/G4 store and removal events since the last call, oldest
        first (a leader created with ``tier_events``; none otherwise), and
        how many events were dropped so far because nobody took them."""
        data = _buffer_call("kvbm_leader_take_events", self._h)
        if not data:
            return [], 0
        evs, dropped = msgpack.unpackb(data, raw=False)
        return [TierEvent(bool(r), int(t), int(h), None if p is None else int(p), list(tok or []))
                for r, t, h, p, tok in evs], int(dropped)

    def restore_disk(self, recovered: Iterable[bytes]) -> int:
        """Register the disk tier blocks the workers' persistent tiers
        recovered: ``recovered`` is every rank's :meth:`Worker.recovered`,
        rank 0 first. Call before the first step. Returns the blocks registered."""
        payload = msgpack.packb([bytes(r) for r in recovered], use_bin_type=True)
        got = c_int64()
        _native.call("kvbm_leader_restore_disk", self._h, payload, len(payload), byref(got))
        return got.value


class Bound(NamedTuple):
    """What :meth:`Worker.bind` reports of a bound plan."""

    loads: dict[str, list[int]]  # request id -> the G1 blocks its load writes
    start: bool  # start_load has loads to launch
    save: bool  # wait_for_save has copies to run


class FinishedLoads(NamedTuple):
    """:meth:`Worker.finished_loads`."""

    loaded: list[str]  # requests whose loads completed
    errors: list[int]  # G1 blocks whose load failed
    failed: list[str]  # the requests of loaded with a failed G1 block


class Worker(_native.Handle):
    """One rank's bytes: the engine's G1 tensors plus kvbm's G2/G3 regions.

    tensors: list of (data_ptr, shape, strides) in layer order (one entry for
    TensorRT-LLM's single tensor). The memory stays owned by the engine.
    """

    _free = "kvbm_worker_free"
    # The requests of the last finished() with a failed G1 block.
    failed_requests: list[str] = []

    def __init__(self, *, tensors: Iterable[tuple[int, Sequence[int], Sequence[int]]], kind: str, num_blocks: int,
                 block_size: int, dtype_bytes: int, rank: int = 0, num_workers: int = 1, model: str = "",
                 dtype: str = "", side_channel: WorkerSideChannelOptions | None = None,
                 layer_groups: Sequence[int] | None = None, group_kinds: Sequence[str] | None = None) -> None:
        opts = {
            "model": str(model),
            "dtype": str(dtype),
            "rank": int(rank),
            "num_workers": int(num_workers),
            "kind": kind,
            "num_blocks": int(num_blocks),
            "block_size": int(block_size),
            "dtype_bytes": int(dtype_bytes),
            "tensors": [
                {"ptr": int(p), "shape": [int(x) for x in shape], "strides": [int(x) for x in strides]}
                for p, shape, strides in tensors
            ],
            "env": _native.env_snapshot(),
        }
        if layer_groups is not None:
            # Each tensor's KV cache group (goext/layout/groups.go).
            opts["layer_groups"] = [int(g) for g in layer_groups]
        if group_kinds is not None:
            # Each group's attention kind and window: part of the fingerprint.
            opts["group_kinds"] = [str(k) for k in group_kinds]
        if side_channel is not None:
            # Returns at once; the handshake completes when the leader runs it
            # (info()["side_channel"]["ready"]), and the leader's background
            # operations then run on this worker.
            opts["side_channel"] = dict(side_channel)
        h = c_uint64()
        _native.call("kvbm_worker_new", json.dumps(opts).encode(), byref(h))
        self._h = h.value
        self._figs = _figure_slots("kvbm_worker_figures_addr", self._h)

    def info(self) -> WorkerInfo:
        info: WorkerInfo = json.loads(_buffer_call("kvbm_worker_info", self._h))
        return info

    def stats(self) -> WorkerStats:
        """This worker's transfer totals per direction since it was created."""
        stats: WorkerStats = json.loads(_buffer_call("kvbm_worker_stats", self._h))
        stats["directions"] = stats.get("directions") or {}
        return stats

    def transfer_seq(self) -> int:
        """How many transfer batches this worker has recorded: :meth:`stats`
        changes only when this does. Read without calling into Go."""
        return int(self._figs[0])

    def bind(self, plan: bytes) -> Bound:
        """Hand the worker a step's plan (:meth:`Leader.step`'s bytes; the
        plan is decoded here only, in Go) and return what the adapter acts
        on: the loads it must report, and whether :meth:`start_load` and
        :meth:`wait_for_save` have work in this step."""
        data = _buffer_call("kvbm_worker_bind", self._h, plan, len(plan))
        if not data:
            return Bound({}, False, False)
        loads, start, save = msgpack.unpackb(data, raw=False)
        return Bound({str(r): [int(b) for b in blocks or ()] for r, blocks in loads or ()}, bool(start), bool(save))

    def start_load(self) -> None:
        _native.call("kvbm_worker_start_load", self._h)

    def wait_loads(self) -> None:
        _native.call("kvbm_worker_wait_loads", self._h)

    def wait_for_save(self) -> None:
        _native.call("kvbm_worker_wait_for_save", self._h)

    def set_cuda_stream(self, stream: int) -> None:
        """Order the next loads/saves after the work queued on the engine's CUDA
        stream (a cudaStream_t). Only the CUDA build has it; a no-op otherwise."""
        if _native.loaded_variant() == "cuda" or hasattr(_native.lib(), "kvbm_worker_set_cuda_stream"):
            _native.call("kvbm_worker_set_cuda_stream", self._h, int(stream))

    def recovered(self) -> bytes:
        """What this rank's persistent disk tier recovered at start, for
        :meth:`Leader.restore_disk` (b"" without a persistent tier)."""
        return _buffer_call("kvbm_worker_recovered", self._h)

    def finished(self) -> tuple[list[str], list[int]]:
        """(request ids whose loads completed, G1 blocks whose load failed)
        since the last call; the requests among them with a failed G1 block
        are then in :attr:`failed_requests`."""
        f = self.finished_loads()
        self.failed_requests = f.failed
        return f.loaded, f.errors

    def finished_loads(self) -> FinishedLoads:
        """:meth:`finished` with the loaded requests that have a failed G1 block."""
        data = _buffer_call("kvbm_worker_finished", self._h)
        if not data:
            return FinishedLoads([], [], [])
        loaded, errors, failed = msgpack.unpackb(data, raw=False)
        return FinishedLoads(list(loaded or []), list(errors or []), list(failed or []))

    def g4_report(self) -> bytes:
        """Blocks stored in G4 since the last call and this process's G4
        counters, for :meth:`Leader.g4_report` (b"" without a G4 tier)."""
        return _buffer_call("kvbm_worker_g4_report", self._h)

    def transfer_timings(self) -> bytes:
        """Rank 0's timed load batches since the last call, for
        :meth:`Leader.transfer_timings` (b"" when there are none, and on other
        ranks)."""
        return _buffer_call("kvbm_worker_transfer_timings", self._h)


class Consolidator(_native.Handle):
    """A standalone KV Event Consolidator (design §7): engine KV events in (ZMQ),
    deduplicated events out (ZMQ PUB in vLLM's format and/or RouterEvent JSON
    on NATS). A Leader started with ``consolidator=`` runs one itself and
    feeds it kvbm's G2/G3 events; this class is for the engine-only case and
    for tests.

    Keywords: engine ("vllm"|"trtllm"|"sglang"), engine_endpoint, zmq_bind, nats (bool),
    nats_url (default NATS_SERVER), namespace, component, worker_id,
    buffer_limit, legacy_subject.
    """

    _free = "kvbm_consolidator_free"

    def __init__(self, **opts: Unpack[ConsolidatorOptions]) -> None:
        payload: dict[str, object] = dict(opts)
        payload["env"] = _native.env_snapshot()
        h = c_uint64()
        _native.call("kvbm_consolidator_new", json.dumps(payload).encode(), byref(h))
        self._h = h.value

    def stats(self) -> ConsolidatorStats:
        stats: ConsolidatorStats = json.loads(_buffer_call("kvbm_consolidator_stats", self._h))
        return stats
