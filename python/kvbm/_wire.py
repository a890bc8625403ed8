"""Typed Python handles over the leader⇄worker side channel (goext/wire).

With tensor parallelism the scheduler-side leader and one worker per rank
live in different processes. The engine still ships each step's plan to every
rank itself (vLLM pickles the connector metadata); this channel carries what
the engine does not: the start-up handshake (every rank reports its shard
geometry, the leader sizes G2/G3 and waits until every rank allocated),
operations not tied to a step, and heartbeats that mark a rank dead.

Call order (vLLM): every worker creates :class:`kvbm._core.Worker` in
``register_kv_caches`` and attaches a :class:`WireWorker` (returns at once);
the scheduler then creates :class:`WireLeader`, calls :meth:`WireLeader.handshake`
and builds :class:`kvbm._core.Leader` (``background=True``) from its result.
After each step's plan, :meth:`BackgroundPump.poll` sends the leader's
background operations (G2->G3 moves) to every rank and commits them, so a
disk block becomes matchable only once every rank wrote its shard.

Endpoints, timeout and sizing come from the ``DYN_KVBM_*`` environment
(``DYN_KVBM_LEADER_ZMQ_HOST`` / ``_PUB_PORT`` / ``_ACK_PORT``,
``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from ctypes import POINTER, byref, c_char_p, c_int64, c_uint8, c_uint64
from dataclasses import dataclass
from typing import TypedDict

from kvbm import _native
from kvbm._errors import KvbmIOError
from kvbm._core import Leader, Worker

_P = POINTER
_ERR = _P(c_char_p)
_native.register_signatures(
    {
        "kvbm_wire_leader_new": (ctypes.c_int, [c_char_p, _P(c_uint64), _ERR]),
        "kvbm_wire_leader_handshake": (ctypes.c_int, [c_uint64, c_int64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_wire_leader_broadcast": (ctypes.c_int, [c_uint64, c_char_p, c_int64, c_int64, _ERR]),
        "kvbm_wire_leader_info": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_wire_leader_free": (None, [c_uint64]),
        "kvbm_wire_worker_connect": (ctypes.c_int, [c_uint64, c_char_p, _P(c_uint64), _ERR]),
        "kvbm_wire_worker_wait_ready": (ctypes.c_int, [c_uint64, c_int64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_wire_worker_info": (ctypes.c_int, [c_uint64, _P(_P(c_uint8)), _P(c_int64), _ERR]),
        "kvbm_wire_worker_free": (None, [c_uint64]),
    }
)

_TRANSPORTS = ("auto", "tcp", "inproc")

log = logging.getLogger("kvbm")


_HANDSHAKE_SLICE_S = 1.0


def _buffer_call(name: str, *args: object) -> bytes:
    buf = _P(c_uint8)()
    n = c_int64()
    _native.call(name, *args, byref(buf), byref(n))
    return _native.take_buffer(buf, n)


def _ms(timeout_s: float | None) -> int:
    return 0 if timeout_s is None else max(1, int(timeout_s * 1000))


def _check_transport(transport: str) -> str:
    if transport not in _TRANSPORTS:
        raise ValueError(f"transport {transport!r}: want one of {_TRANSPORTS}")
    return transport


class WireLeaderInfo(TypedDict):
    """:meth:`WireLeader.info`."""

    transport: str  # "tcp" or "inproc"
    pub_port: int
    ack_port: int
    healthy: bool
    dead_ranks: list[int]  # processes gone, for good
    suspect_ranks: list[int]  # silent; re-admitted when they answer again
    forged_messages: int  # messages rejected: wrong secret or forged


class WireWorkerInfo(TypedDict):
    """:meth:`WireWorker.info`."""

    ready: bool
    stopped: bool
    error: str  # "" while healthy
    forged_messages: int
    reconnects: int  # subscriptions redialed after the leader's PUB dropped or went silent


@dataclass(frozen=True)
class Handshake:
    """What every rank agreed on, and the tier sizes the leader chose."""

    num_workers: int
    bytes_per_block: int  # one rank's share of a block: Leader(bytes_per_block=...)
    num_device_blocks: int
    num_host_blocks: int
    num_disk_blocks: int


@dataclass(frozen=True)
class LeaderMetadata:
    """The leader's tier sizes as one worker received them."""

    num_host_blocks: int
    num_disk_blocks: int
    world_size: int


class WireLeader(_native.Handle):
    """The scheduler side of the side channel: binds at construction.

    A taken port raises :class:`kvbm.KvbmIOError` naming
    ``DYN_KVBM_LEADER_ZMQ_PUB_PORT`` / ``_ACK_PORT``. ``transport="auto"`` runs
    in-process (no ports) when ``num_workers == 1``.
    """

    _free = "kvbm_wire_leader_free"

    def __init__(self, *, num_workers: int, transport: str = "auto", ping_interval_ms: int = 0,
                 suspect_after_ms: int = 0, secret: str = "") -> None:
        opts = {
            "secret": str(secret),
            "num_workers": int(num_workers),
            "transport": _check_transport(transport),
            "ping_interval_ms": int(ping_interval_ms),
            "suspect_after_ms": int(suspect_after_ms),
            "env": _native.env_snapshot(),
        }
        h = c_uint64()
        _native.call("kvbm_wire_leader_new", json.dumps(opts).encode(), byref(h))
        self._h = h.value
        self.num_workers = int(num_workers)

    def handshake(self, timeout_s: float | None = None) -> Handshake:
        """Block until every rank reported and allocated (releases the GIL).

        Bounded by ``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS`` and
        ``timeout_s``; the timeout error names the ranks that never answered.
        """
        # Waits in slices of at most a second, so Ctrl-C (or any signal
        # handler) interrupts it within a second; the native call releases
        # the GIL but Python runs signal handlers only between calls.
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = _HANDSHAKE_SLICE_S if end is None else min(_HANDSHAKE_SLICE_S, end - time.monotonic())
            data = _buffer_call("kvbm_wire_leader_handshake", self._h, _ms(max(left, 0.001)))
            if data:
                return Handshake(**json.loads(data))
            if end is not None and time.monotonic() >= end:
                raise KvbmIOError(
                    f"kvbm leader: leader/worker handshake not complete within timeout_s={timeout_s}; it goes "
                    f"on until DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS (call handshake() again to keep waiting)")

    def broadcast(self, plan: bytes, timeout_s: float | None = None) -> None:
        """Run an encoded plan on every rank; return once all acked.

        Raises :class:`kvbm.KvbmStateError` naming a dead or suspected rank
        (nothing is sent), :class:`kvbm.KvbmIOError` naming a rank whose
        execution failed.
        """
        _native.call("kvbm_wire_leader_broadcast", self._h, plan, len(plan), _ms(timeout_s))

    def info(self) -> WireLeaderInfo:
        """{transport, pub_port, ack_port, healthy, dead_ranks, suspect_ranks}.

        A dead rank's process is gone (for good); a suspected one has been
        silent for ``DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS`` and is
        re-admitted when it answers again."""
        info: WireLeaderInfo = json.loads(_buffer_call("kvbm_wire_leader_info", self._h))
        return info

    @property
    def dead_ranks(self) -> list[int]:
        return list(self.info()["dead_ranks"])

    @property
    def suspect_ranks(self) -> list[int]:
        return list(self.info()["suspect_ranks"])


class WireWorker(_native.Handle):
    """One rank's side of the side channel, attached to its :class:`kvbm._core.Worker`.

    Returns at once; the handshake completes in the background when the leader
    runs it. Close it before the worker.
    """

    _free = "kvbm_wire_worker_free"

    def __init__(self, worker: Worker, *, rank: int, num_workers: int, transport: str = "auto",
                 secret: str = "") -> None:
        opts = {
            "secret": str(secret),
            "rank": int(rank),
            "num_workers": int(num_workers),
            "transport": _check_transport(transport),
            "env": _native.env_snapshot(),
        }
        h = c_uint64()
        _native.call("kvbm_wire_worker_connect", worker._h, json.dumps(opts).encode(), byref(h))
        self._h = h.value
        self.rank = int(rank)
        # Operations broadcast by the leader run on this worker: keep it
        # alive at least as long as the side channel.
        self._worker = worker

    def wait_ready(self, timeout_s: float | None = None) -> LeaderMetadata:
        """Block until the leader's handshake completed for this rank."""
        d = json.loads(_buffer_call("kvbm_wire_worker_wait_ready", self._h, _ms(timeout_s)))
        return LeaderMetadata(**d)

    def info(self) -> WireWorkerInfo:
        """{ready, stopped, error, forged_messages, reconnects}."""
        info: WireWorkerInfo = json.loads(_buffer_call("kvbm_wire_worker_info", self._h))
        return info


class BackgroundPump:
    """Runs a leader's background operations over the side channel.

    :meth:`poll` is called once per engine step, after ``Leader.step``, from the
    engine's scheduler thread, and never blocks it: at most one operation is
    in flight, broadcast and committed on a helper thread (the native calls
    release the GIL). An operation every rank acked is committed ok (its G3
    blocks become matchable and are announced); a failed or timed-out one is
    committed failed (its blocks are freed, its moves retried). While a rank
    is suspected (silent) nothing new is started; its moves wait in the
    leader's queue until it answers again. Once the side channel reports a
    dead rank (its process is gone) the leader is set degraded
    (``Leader.set_degraded``) and nothing more is sent.

    Workers run an operation only after the engine step it follows has saved
    its blocks on their rank (``worker.Run``), so the broadcast must not run on
    the scheduler thread: that step is shipped only after ``poll`` returns.
    """

    def __init__(self, wire: WireLeader, leader: Leader, *, timeout_s: float = 60.0) -> None:
        self._wire = wire
        self._leader = leader
        self._timeout_s = float(timeout_s)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._inflight = 0  # ticket of the operation in flight, 0: none
        self.degraded = False
        self.dead_ranks: list[int] = []
        self.committed = 0
        self.failed = 0
        self.last_error: str | None = None

    def poll(self) -> bool:
        """Start the next operation if none is in flight; True if one was started."""
        with self._lock:
            if self._stopped or self.degraded:
                return False
            # Checked even with an operation in flight: a rank that died makes
            # it wait for its timeout (the live ranks may be waiting for a step
            # that will not come), but the leader must stop matching now.
            info = self._wire.info()
            if self._check_dead(info["dead_ranks"]):
                return False
            if self._thread is not None and self._thread.is_alive():
                return False
            if info["suspect_ranks"]:
                return False
            plan, ticket = self._leader.plan_background()
            if not ticket:
                return False
            self._inflight = ticket
            self._thread = threading.Thread(target=self._run, args=(plan, ticket), name="kvbm-background",
                                            daemon=True)
            self._thread.start()
            return True

    def _check_dead(self, dead: list[int]) -> bool:
        # Called with self._lock held.
        if dead and not self.degraded:
            self.degraded, self.dead_ranks = True, list(dead)
            self._leader.set_degraded(dead)
            if self._inflight:
                # Its broadcast may wait for its whole timeout (the live ranks
                # can be waiting for a step that will not come); fail it now
                # so its pins go. Should it still run on some ranks, that is
                # harmless (see goext/leader/background.go).
                ticket, self._inflight = self._inflight, 0
                self._leader.commit_background(ticket, False)
                self.failed += 1
        return bool(dead)

    def _run(self, plan: bytes, ticket: int) -> None:
        ok = False
        try:
            self._wire.broadcast(plan, timeout_s=self._timeout_s)
            ok = True
        except Exception as e:  # noqa: BLE001 - a failed operation only frees its blocks
            self.last_error = str(e)
            log.warning("kvbm: background operation %d failed; its disk blocks are freed: %s", ticket, e)
        try:
            with self._lock:
                if self._inflight != ticket:
                    return  # already failed when the leader went degraded
                self._inflight = 0
                self._leader.commit_background(ticket, ok)
                if ok:
                    self.committed += 1
                else:
                    self.failed += 1
                    self._check_dead(self._wire.dead_ranks)
        except Exception:  # noqa: BLE001 - leader closed under us at shutdown
            log.debug("kvbm: could not commit background operation %d", ticket, exc_info=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the operation in flight; True when none is left."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            return not t.is_alive()
        return True

    def stop(self) -> None:
        """Start nothing more. Shutdown order: ``stop()``, close the WireLeader
        (an operation in flight then fails at once), ``wait()``, close the Leader."""
        with self._lock:
            self._stopped = True
