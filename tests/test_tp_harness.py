"""Tensor parallel 2 without an engine: replays vLLM's multi-worker call order.

One leader process (vLLM's EngineCore: scheduler + executor) and two worker
processes (vLLM's MultiprocExecutor workers), started with multiprocessing
'spawn' as vLLM does. The handshake runs over kvbm's side channel
(ZeroMQ over TCP, owned by kvbm._core.Leader and Worker); each step's plan from kvbm._core.Leader.step
travels to every worker pickled inside connector metadata, as vLLM ships
SchedulerOutput. Workers hold numpy CPU tensors (vLLM CPU backend layout
[2, N, H, bs, D] per layer) filled with rank-specific random bytes and check
byte for byte that what they onboard is what they offloaded on their own rank.

vLLM's order (reference/vllm.md §1.5): workers register their KV caches
first; the scheduler's connector (our leader) is created afterwards, so the
leader's handshake finds workers already waiting. Per step: scheduler
get_num_new_matched_tokens / update_state_after_alloc / build_connector_meta;
workers bind_connector_metadata → start_load_kv → forward → wait_for_save
(skipped on a step without scheduled tokens) → get_finished; the executor
reports a request finished loading once every rank reported it
(KVOutputAggregator).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
from dataclasses import dataclass

import pytest

import tp_procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "python", "kvbm", "lib", "libkvbm.so")

pytestmark = pytest.mark.skipif(not os.path.exists(LIB), reason="native library not built (make build)")

WORLD = 2
NUM_BLOCKS = 32
BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 16
LAYERS = 3
PROMPT_BLOCKS = 6
TIMEOUT = 60


@dataclass
class ConnectorMetadata:
    """Stands in for DynamoConnectorMetadata (importing vLLM costs seconds per process)."""

    plan: bytes = b""
    seq: int = 0


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _block_bytes(layers, b: int) -> bytes:
    # One G1 block on this rank: K and V of every layer (CPU layout [2, N, H, bs, D]).
    return b"".join(t[:, b].tobytes() for t in layers)


def _worker_main(rank: int, env: dict, cmds, out):
    os.environ.update(env)
    import numpy as np

    from kvbm import _plan
    from kvbm._core import Worker

    # initialize_kv_cache: the engine allocates and owns the tensors.
    rng = np.random.default_rng(1000 + rank)
    layers = []
    for _ in range(LAYERS):
        raw = rng.integers(0, 256, size=2 * NUM_BLOCKS * HEADS * BLOCK_SIZE * HEAD_DIM * 2, dtype=np.uint8)
        layers.append(raw.view(np.float16).reshape(2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM))
    # register_kv_caches: kvbm worker with its side channel (returns at once;
    # the scheduler, and so the leader, does not exist yet).
    tensors = [(t.ctypes.data, t.shape, [s // t.itemsize for s in t.strides]) for t in layers]
    worker = Worker(tensors=tensors, kind="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype_bytes=2,
                    rank=rank, num_workers=WORLD, side_channel={"transport": "tcp"})
    out.put(("registered", rank, worker.info()["bytes_per_block"]))

    saved = {}  # G2 block -> bytes this rank saved into it
    pending = []  # (G2 src, G1 dst) of loads not verified yet
    verified = 0
    mismatches = []
    while True:
        cmd = cmds.get(timeout=TIMEOUT)
        if cmd[0] == "close":
            break
        _, pickled, scheduled = cmd
        meta = pickle.loads(pickled)  # what vLLM's worker receives
        plan = _plan.decode(meta.plan)
        for _, g1, _, g2 in plan["saves"]:  # G1 -> G2 after the forward pass
            saved[g2] = _block_bytes(layers, g1)
        for copies in plan["loads"].values():
            pending.extend((src, dst) for _, src, _, dst in copies)
        worker.bind(meta.plan)  # bind_connector_metadata
        worker.start_load()  # start_load_kv
        if scheduled:  # the forward pass ran; kv_connector_no_forward skips wait_for_save
            worker.wait_for_save()
        loaded, errors = worker.finished()  # get_finished
        if not loaded and pending:
            worker.wait_loads()  # the executor polls get_finished again next step; be deterministic here
            more, more_err = worker.finished()
            loaded, errors = loaded + more, errors + more_err
        if loaded:
            for src, dst in pending:
                if _block_bytes(layers, dst) == saved.get(src):
                    verified += 1
                else:
                    mismatches.append((src, dst))
            pending = []
        out.put(("step", rank, sorted(loaded), sorted(errors), verified, mismatches))
    sc = worker.info()["side_channel"]
    worker.close()
    out.put(("closed", rank, sc))


def _leader_main(env: dict, to_workers, from_workers, results, cmds):
    os.environ.update(env)
    from kvbm import _plan
    from kvbm._core import Leader

    leader = None

    def collect(kind):
        return tp_procs.collect(from_workers, kind, WORLD, TIMEOUT, lambda: tp_procs.dead_ranks(leader))

    reg = collect("registered")  # the executor initialised every worker first
    leader = Leader(block_size=BLOCK_SIZE, num_workers=WORLD,
                    side_channel={"transport": "tcp", "ping_interval_ms": 100, "suspect_after_ms": 30000})
    leader.wait_ready(timeout_s=TIMEOUT)
    info = leader.info()
    seq = 0

    def engine_step(updates, loaded=(), scheduled=True):
        # build_connector_meta → pickled to every worker with SchedulerOutput.
        nonlocal seq
        seq += 1
        plan = leader.step(updates, loaded=loaded)
        pickled = pickle.dumps(ConnectorMetadata(plan=plan, seq=seq))
        for q in to_workers:
            q.put(("step", pickled, scheduled))
        return plan, collect("step")

    tokens = list(range(5000, 5000 + PROMPT_BLOCKS * BLOCK_SIZE))
    # Request "a": nothing cached; prefill writes G1 blocks 0..5, write-through saves them.
    assert leader.match("a", tokens, 0, 0) == (0, False)
    ids_a = list(range(PROMPT_BLOCKS))
    plan_a, outs = engine_step([["a", tokens, ids_a, 0, len(tokens), 0, 0, False]])
    leader.request_finished("a")

    # Request "b" shares the prompt: it matches in G2 and loads into G1 blocks 20..26.
    tokens_b = tokens + [1, 2, 3]
    n_ext, is_async = leader.match("b", tokens_b, 0, 0)
    ids_b = list(range(20, 20 + PROMPT_BLOCKS + 1))
    leader.update_after_alloc("b", ids_b, n_ext)
    plan_b, outs = engine_step([], scheduled=False)  # b waits for its KV: no forward for it
    # KVOutputAggregator: finished loading once every rank reported it.
    counts = {}
    for o in outs.values():
        for rid in o[2]:
            counts[rid] = counts.get(rid, 0) + 1
    finished_recving = sorted(r for r, c in counts.items() if c == WORLD)
    engine_step([], loaded=finished_recving, scheduled=False)

    results.put({
        "registered_bpb": {r: m[2] for r, m in reg.items()},
        "info": info,
        "n_ext": n_ext,
        "is_async": is_async,
        "saves": len(_plan.decode(plan_a)["saves"]),
        "loads": sum(len(cs) for cs in _plan.decode(plan_b)["loads"].values()),
        "finished_recving": finished_recving,
        "verified": {r: o[4] for r, o in outs.items()},
        "mismatches": {r: o[5] for r, o in outs.items()},
        "load_errors": {r: o[3] for r, o in outs.items()},
    })

    # pytest kills rank 1 now; the leader's next step notices it and degrades.
    assert cmds.get(timeout=TIMEOUT) == "after_kill"
    start = time.monotonic()
    while not leader.info()["degraded"] and time.monotonic() - start < 30:
        leader.step([])  # wakes the leader's side-channel loop, which checks for dead ranks
        time.sleep(0.05)
    info = leader.info()
    results.put({"degraded": info["degraded"], "dead_after_s": time.monotonic() - start,
                 "dead_ranks": info["dead_ranks"], "side_channel_dead": info["side_channel"]["dead_ranks"],
                 "match_after": leader.match("z", list(range(5000, 5000 + PROMPT_BLOCKS * BLOCK_SIZE)), 0, 0)})
    to_workers[0].put(("close",))
    closed = from_workers.get(timeout=TIMEOUT)
    results.put({"closed": closed})
    leader.close()


def _result(results, procs, timeout):
    """Next result from the leader; fails at once if a process exited with an error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            bad = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0, -9)]
            if bad:
                pytest.fail(f"harness process failed: {bad} (see captured stderr)")
            if time.monotonic() > deadline:
                pytest.fail(f"no result from the leader process within {timeout}s "
                            f"(exit codes {[p.exitcode for p in procs]})")


def test_tp2_vllm_call_order_byte_exact():
    ctx = mp.get_context("spawn")
    pub, ack = _free_ports(2)
    env = {
        "PYTHONPATH": os.path.join(ROOT, "python"),
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "24",
        "DYN_KVBM_LEADER_ZMQ_HOST": "127.0.0.1",
        "DYN_KVBM_LEADER_ZMQ_PUB_PORT": str(pub),
        "DYN_KVBM_LEADER_ZMQ_ACK_PORT": str(ack),
        "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "60",
    }
    to_workers = [ctx.Queue() for _ in range(WORLD)]
    from_workers, results, leader_cmds = ctx.Queue(), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=_worker_main, args=(r, env, to_workers[r], from_workers)) for r in range(WORLD)]
    lp = ctx.Process(target=_leader_main, args=(env, to_workers, from_workers, results, leader_cmds))
    procs = workers + [lp]
    try:
        for p in procs:
            p.start()
        res = _result(results, procs, 120)

        sc = res["info"]["side_channel"]
        bpb = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2
        assert res["registered_bpb"] == {0: bpb, 1: bpb}
        assert (sc["bytes_per_block"], sc["num_device_blocks"], res["info"]["host_blocks"]) == (bpb, NUM_BLOCKS, 24)
        assert res["saves"] == PROMPT_BLOCKS
        assert (res["n_ext"], res["is_async"]) == (PROMPT_BLOCKS * BLOCK_SIZE, True)
        assert res["loads"] == PROMPT_BLOCKS
        assert res["finished_recving"] == ["b"]
        assert res["load_errors"] == {0: [], 1: []}
        assert res["mismatches"] == {0: [], 1: []}
        assert res["verified"] == {0: PROMPT_BLOCKS, 1: PROMPT_BLOCKS}, "every rank onboarded its own bytes exactly"
        assert sc["healthy"] and sc["dead_ranks"] == [] and sc["transport"] == "tcp"

        # A worker dies: the leader notices within the heartbeat bound and degrades.
        workers[1].kill()
        workers[1].join(10)
        leader_cmds.put("after_kill")
        dead = _result(results, [lp, workers[0]], 60)
        assert dead["degraded"] and dead["dead_ranks"] == [1] and dead["side_channel_dead"] == [1], dead
        assert dead["dead_after_s"] < 30, "a dead rank is noticed within the heartbeat bound"
        assert dead["match_after"] == (0, False), "degraded: nothing is matched"
        closed = _result(results, [lp, workers[0]], 60)["closed"]
        assert closed[0] == "closed" and closed[2]["ready"] and closed[2]["error"] == "", closed
        lp.join(30)
        workers[0].join(30)
        assert lp.exitcode == 0 and workers[0].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def test_handshake_timeout_names_missing_ranks(monkeypatch):
    from kvbm._core import Leader
    from kvbm._errors import KvbmIOError

    pub, ack = _free_ports(2)
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", str(pub))
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_ACK_PORT", str(ack))
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    monkeypatch.setenv("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "1")
    with Leader(block_size=BLOCK_SIZE, num_workers=2, side_channel={"transport": "tcp"}) as leader:
        with pytest.raises(KvbmIOError) as ei:
            leader.wait_ready()
    msg = str(ei.value)
    assert "rank(s) [0 1] of 2 never answered" in msg
    assert "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS" in msg


def test_port_conflict_names_variable(monkeypatch):
    from kvbm._core import Leader
    from kvbm._errors import KvbmIOError

    pub, ack = _free_ports(2)
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", str(pub))
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_ACK_PORT", str(ack))
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    with Leader(block_size=BLOCK_SIZE, num_workers=2, side_channel={"transport": "tcp"}):
        with pytest.raises(KvbmIOError) as ei:
            Leader(block_size=BLOCK_SIZE, num_workers=2, side_channel={"transport": "tcp"})
    assert f"DYN_KVBM_LEADER_ZMQ_PUB_PORT={pub}" in str(ei.value)
    assert "give each engine its own" in str(ei.value)


def test_tp1_in_process(monkeypatch):
    """TP=1: scheduler and worker in one process; the same protocol runs without ports."""
    import numpy as np

    from kvbm._core import Leader, Worker
    from kvbm._errors import KvbmStateError

    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    # Ports another test may hold: in-process needs none of them.
    pub, ack = _free_ports(2)
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", str(pub))
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_ACK_PORT", str(ack))
    kv = [np.zeros((2, 8, HEADS, BLOCK_SIZE, HEAD_DIM), dtype=np.float16) for _ in range(2)]
    worker = Worker(tensors=[(t.ctypes.data, t.shape, [s // 2 for s in t.strides]) for t in kv], kind="cpu",
                    num_blocks=8, block_size=BLOCK_SIZE, dtype_bytes=2, side_channel={})
    assert worker.info()["side_channel"]["error"] == ""
    with Leader(block_size=BLOCK_SIZE, side_channel={}) as leader:
        with pytest.raises(KvbmStateError, match="not ready"):
            leader.info()
        leader.wait_ready(timeout_s=10)
        leader.wait_ready(timeout_s=10)  # ready: returns at once
        info = leader.info()
        assert info["side_channel"]["transport"] == "inproc"
        assert (info["host_blocks"], info["side_channel"]["num_device_blocks"]) == (8, 8)
        assert leader.step([]) is not None
        deadline = time.monotonic() + 10
        while not worker.info()["side_channel"]["ready"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.info()["side_channel"]["ready"]
    with Leader(block_size=BLOCK_SIZE, bytes_per_block=64) as plain:
        assert "side_channel" not in plain.info()
        plain.wait_ready()  # no side channel: ready at once
    worker.close()


def test_handshake_wait_is_interruptible(monkeypatch):
    """Ctrl-C during the (30 min by default) handshake wait is not ignored."""
    import signal

    from kvbm._core import Leader

    pub, ack = _free_ports(2)
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", str(pub))
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_ACK_PORT", str(ack))
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Leader(block_size=BLOCK_SIZE, num_workers=2, side_channel={"transport": "tcp"}) as leader:
            start = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                leader.wait_ready()
            # Generous bound against the 1800 s default: only "not ignored" is checked.
            assert time.monotonic() - start < 60
            # The interrupted wait can be resumed (and is still pending: no workers).
            with pytest.raises(Exception, match="within timeout_s=0.2"):
                leader.wait_ready(timeout_s=0.2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
