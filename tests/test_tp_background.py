"""Tensor parallel 2: G2->G3 moves over the side channel (background operations).

Same setup as test_tp_harness (a leader process and two worker processes
started with 'spawn', vLLM's call order, numpy CPU tensors as G1), with a disk
tier and the leader in background mode: G2->G3 moves leave the per-step plans
and are broadcast over kvbm's side channel; a G3 block becomes matchable only
once both ranks acked writing their shard. Then a worker is killed: the leader
notices, goes degraded (matching returns nothing) and nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time

import pytest

import tp_procs

from test_tp_harness import (
    BLOCK_SIZE,
    HEAD_DIM,
    HEADS,
    LAYERS,
    LIB,
    NUM_BLOCKS,
    PROMPT_BLOCKS,
    TIMEOUT,
    WORLD,
    ConnectorMetadata,
    _block_bytes,
    _free_ports,
    _result,
)

pytestmark = pytest.mark.skipif(not os.path.exists(LIB), reason="native library not built (make build)")

HOST_BLOCKS = 8
DISK_BLOCKS = 24


def _worker_main(rank: int, env: dict, cmds, out):
    os.environ.update(env)
    import numpy as np

    from kvbm import _plan
    from kvbm._core import Worker
    from kvbm._wire import WireWorker

    rng = np.random.default_rng(2000 + rank)
    layers = []
    for _ in range(LAYERS):
        raw = rng.integers(0, 256, size=2 * NUM_BLOCKS * HEADS * BLOCK_SIZE * HEAD_DIM * 2, dtype=np.uint8)
        layers.append(raw.view(np.float16).reshape(2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM))
    tensors = [(t.ctypes.data, t.shape, [s // t.itemsize for s in t.strides]) for t in layers]
    worker = Worker(tensors=tensors, kind="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype_bytes=2,
                    rank=rank, num_workers=WORLD)
    wire = WireWorker(worker, rank=rank, num_workers=WORLD, transport="tcp")
    out.put(("registered", rank))

    saved = {}  # (tier, block) -> the bytes this rank wrote there
    pending = []  # ((tier, src), G1 dst) of loads not verified yet
    verified, mismatches = 0, []
    while True:
        cmd = cmds.get(timeout=TIMEOUT)
        if cmd[0] == "close":
            break
        _, pickled, scheduled, moves = cmd
        # Background moves the leader ran over the side channel since the
        # last step (each rank ran them in Go; mirror them in the model).
        for _, g2, _, g3 in moves:
            saved[(3, g3)] = saved.get((2, g2))
        meta = pickle.loads(pickled)
        plan = _plan.decode(meta.plan)
        for _, g1, tier, dst in plan["saves"]:
            saved[(tier, dst)] = _block_bytes(layers, g1)
        for copies in plan["loads"].values():
            pending.extend(((st, src), dst) for st, src, _, dst in copies)
        worker.bind(meta.plan)
        worker.start_load()
        if scheduled:
            worker.wait_for_save()
        loaded, errors = worker.finished()
        if not loaded and pending:
            worker.wait_loads()
            more, more_err = worker.finished()
            loaded, errors = loaded + more, errors + more_err
        if loaded:
            for src, dst in pending:
                if saved.get(src) is not None and _block_bytes(layers, dst) == saved[src]:
                    verified += 1
                else:
                    mismatches.append((src, dst))
            pending = []
        out.put(("step", rank, sorted(loaded), sorted(errors), verified, mismatches))
    import faulthandler

    # Should a close hang, the captured stderr shows where (the leader gives up after TIMEOUT).
    faulthandler.dump_traceback_later(TIMEOUT / 2, exit=False)
    wire.close()  # must not hang on an operation waiting for a step that never came
    worker.close()
    faulthandler.cancel_dump_traceback_later()
    out.put(("closed", rank))


def _leader_main(env: dict, to_workers, from_workers, results, cmds):
    os.environ.update(env)
    from kvbm import _plan
    from kvbm._core import Leader
    from kvbm._wire import BackgroundPump, WireLeader

    wl = None

    def collect(kind):
        return tp_procs.collect(from_workers, kind, WORLD, TIMEOUT,
                                lambda: wl.dead_ranks if wl is not None else [])

    collect("registered")
    wl = WireLeader(num_workers=WORLD, transport="tcp", ping_interval_ms=100, suspect_after_ms=30000)
    hs = wl.handshake(timeout_s=TIMEOUT)
    leader = Leader(block_size=BLOCK_SIZE, bytes_per_block=hs.bytes_per_block, num_workers=WORLD, background=True)
    pump = BackgroundPump(wl, leader, timeout_s=TIMEOUT)
    seq = 0
    moves_since = []  # background moves to mirror in the workers' model

    def engine_step(updates, loaded=(), scheduled=True):
        nonlocal seq, moves_since
        seq += 1
        plan = leader.step(updates, loaded=loaded)
        pickled = pickle.dumps(ConnectorMetadata(plan=plan, seq=seq))
        moves, moves_since = moves_since, []
        for q in to_workers:
            q.put(("step", pickled, scheduled, moves))
        return plan, collect("step")

    res = {}
    tokens = list(range(7000, 7000 + PROMPT_BLOCKS * BLOCK_SIZE))
    plan_a, _ = engine_step([["a", tokens, list(range(PROMPT_BLOCKS)), 0, len(tokens), 0, 0, False]])
    leader.request_finished("a")
    res["step_moves_a"] = len(_plan.decode(plan_a)["moves"])

    # 1. By hand: plan, broadcast, commit; the blocks are in G3 only after the commit.
    bg, ticket = leader.plan_background()
    res["bg_moves"] = _plan.decode(bg)["moves"]
    res["disk_used_planned"] = leader.info()["disk_blocks_used"]
    wl.broadcast(bg, timeout_s=TIMEOUT)  # both ranks acked
    res["disk_used_acked"] = leader.info()["disk_blocks_used"]
    leader.commit_background(ticket, True)
    res["disk_used_committed"] = leader.info()["disk_blocks_used"]
    moves_since.extend(res["bg_moves"])

    # 2. Request "c" fills G2 (evicting a's blocks); its moves go through the pump.
    tokens_c = list(range(9000, 9000 + HOST_BLOCKS * BLOCK_SIZE))
    plan_c, _ = engine_step([["c", tokens_c, list(range(8, 8 + HOST_BLOCKS)), 0, len(tokens_c), 0, 0, False]])
    leader.request_finished("c")
    res["saves_c"] = len(_plan.decode(plan_c)["saves"])
    res["pump_started"] = pump.poll()
    res["pump_done"] = pump.wait(TIMEOUT)
    res["pump_committed"] = pump.committed
    res["disk_used_after_c"] = leader.info()["disk_blocks_used"]
    res["info_after_c"] = leader.info()

    # 3. "b" shares a's prompt: a's G2 copies are gone, so it loads from G3 on both ranks.
    tokens_b = tokens + [1, 2, 3]
    res["match_b"] = leader.match("b", tokens_b, 0, 0)
    leader.update_after_alloc("b", list(range(20, 20 + PROMPT_BLOCKS + 1)), res["match_b"][0])
    plan_b, outs = engine_step([], scheduled=False)
    res["load_tiers_b"] = sorted({c[0] for cs in _plan.decode(plan_b)["loads"].values() for c in cs})
    counts = {}
    for o in outs.values():
        for rid in o[2]:
            counts[rid] = counts.get(rid, 0) + 1
    res["finished_recving"] = sorted(r for r, c in counts.items() if c == WORLD)
    res["verified"] = {r: o[4] for r, o in outs.items()}
    res["mismatches"] = {r: o[5] for r, o in outs.items()}
    res["load_errors"] = {r: o[3] for r, o in outs.items()}
    engine_step([], loaded=res["finished_recving"], scheduled=False)
    results.put(res)

    # 4. pytest kills rank 1. New blocks are queued for disk; the pump must
    # notice the dead rank, degrade the leader, and never hang.
    assert cmds.get(timeout=TIMEOUT) == "after_kill"
    start = time.monotonic()
    tokens_d = list(range(11000, 11000 + 4 * BLOCK_SIZE))
    leader.step([["d", tokens_d, [28, 29, 30, 31], 0, len(tokens_d), 0, 0, False]])  # not shipped: rank 1 is gone
    while not pump.degraded and time.monotonic() - start < 30:
        pump.poll()
        time.sleep(0.05)
    dead = {
        "degraded_after_s": time.monotonic() - start,
        "pump_degraded": pump.degraded,
        "pump_dead_ranks": pump.dead_ranks,
        "info": leader.info(),
        "match_after": leader.match("e", tokens_b, 0, 0),
        "plan_after": leader.plan_background(),
        "inflight_at_degrade": leader.info()["background_inflight"],
        "disk_used": leader.info()["disk_blocks_used"],
    }
    # Rank 0 may be holding d's operation, waiting for step d's saves that
    # never come; closing its side channel abandons it, and the operation
    # fails instead of hanging.
    to_workers[0].put(("close",))
    closed = from_workers.get(timeout=TIMEOUT)
    dead["worker0_closed"] = closed[0] == "closed"
    dead["closed_after_s"] = time.monotonic() - start
    # Shutdown order: nothing new, the side channel (fails what is in flight), the leader.
    pump.stop()
    wl.close()
    dead["pump_idle"] = pump.wait(10)
    leader.close()
    results.put(dead)


def test_tp2_background_moves_over_the_side_channel():
    ctx = mp.get_context("spawn")
    pub, ack = _free_ports(2)
    env = {
        "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(LIB)), ".."),
                                      os.path.dirname(os.path.abspath(__file__))]),
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(HOST_BLOCKS),
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(DISK_BLOCKS),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_LEADER_ZMQ_HOST": "127.0.0.1",
        "DYN_KVBM_LEADER_ZMQ_PUB_PORT": str(pub),
        "DYN_KVBM_LEADER_ZMQ_ACK_PORT": str(ack),
        "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "60",
    }
    import tempfile

    tmp = tempfile.mkdtemp(prefix="kvbm-tp-bg-")
    env["DYN_KVBM_DISK_CACHE_DIR"] = tmp
    to_workers = [ctx.Queue() for _ in range(WORLD)]
    from_workers, results, leader_cmds = ctx.Queue(), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=_worker_main, args=(r, env, to_workers[r], from_workers)) for r in range(WORLD)]
    lp = ctx.Process(target=_leader_main, args=(env, to_workers, from_workers, results, leader_cmds))
    procs = workers + [lp]
    try:
        for p in procs:
            p.start()
        res = _result(results, procs, 120)

        assert res["step_moves_a"] == 0, "background mode: no moves in the step plans"
        assert len(res["bg_moves"]) == PROMPT_BLOCKS
        assert res["disk_used_planned"] == 0 and res["disk_used_acked"] == 0, "not in G3 before the commit"
        assert res["disk_used_committed"] == PROMPT_BLOCKS
        assert res["saves_c"] == HOST_BLOCKS
        assert res["pump_started"] and res["pump_done"] and res["pump_committed"] == 1
        assert res["disk_used_after_c"] == PROMPT_BLOCKS + HOST_BLOCKS
        assert res["info_after_c"]["background_inflight"] == 0
        assert res["match_b"] == (PROMPT_BLOCKS * BLOCK_SIZE, True)
        assert res["load_tiers_b"] == [3], "a's G2 copies were evicted: every block comes from G3"
        assert res["finished_recving"] == ["b"]
        assert res["load_errors"] == {0: [], 1: []}
        assert res["mismatches"] == {0: [], 1: []}
        assert res["verified"] == {0: PROMPT_BLOCKS, 1: PROMPT_BLOCKS}, "every rank loaded its own shard from disk"

        workers[1].kill()
        workers[1].join(10)
        leader_cmds.put("after_kill")
        dead = _result(results, [lp, workers[0]], 90)
        assert dead["pump_degraded"] and dead["pump_dead_ranks"] == [1], dead
        assert dead["info"]["degraded"] and dead["info"]["dead_ranks"] == [1]
        assert dead["degraded_after_s"] < 30
        assert dead["match_after"] == (0, False), "degraded: nothing is matched"
        assert dead["plan_after"] == (b"", 0)
        assert dead["worker0_closed"]
        assert dead["inflight_at_degrade"] == 0, "the operation in flight was failed when the leader degraded"
        assert dead["pump_idle"], dead
        assert dead["disk_used"] == PROMPT_BLOCKS + HOST_BLOCKS, "d's blocks never reached G3"
        assert dead["closed_after_s"] < 45, dead
        lp.join(30)
        workers[0].join(30)
        assert lp.exitcode == 0 and workers[0].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
