"""Tensor parallel 2 on the CUDA data path: one leader process and two worker
processes, rank r's KV cache on cuda:r (both on cuda:0 when the machine has
one GPU), real torch CUDA tensors in vLLM's FlashAttention layout and
TensorRT-LLM's layout, through the CUDA build of the library.

The leader plans over kvbm's side channel (handshake, per-step plans shipped
to every rank pickled as connector metadata, background G2→G3 moves broadcast
and committed once both ranks acked), as in test_tp_background with numpy
tensors. Every rank fills its cache with its own random bytes, offloads from
G1, onboards into other G1 blocks from G2, and later, after its G2 copies
were evicted, from G3; each rank checks byte for byte that what it onboarded
is what it saved on its own device. A copier that used another device than
its tensors' (device 0, say) would fail the checks or the copies of rank 1 on
a two-GPU machine.

Skipped without torch, without a CUDA device, or when the CUDA variant of the
library is not the one selected.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time

import pytest

import tp_procs

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from test_tp_harness import ConnectorMetadata, _free_ports, _result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
LAYERS, HEADS, DIM, BS = 4, 2, 64, 16
NUM_BLOCKS = 32
HOST_BLOCKS = 8
DISK_BLOCKS = 24
PROMPT_BLOCKS = 6
TIMEOUT = 90


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    from kvbm import _native

    _, variant = _native.library_path()
    if variant != "cuda":
        pytest.skip("the CUDA library is not selected (build it with `make cuda`)")


def rank_device(rank: int) -> int:
    """The GPU of rank r: cuda:r, or cuda:0 for every rank on a one-GPU machine."""
    return rank if torch.cuda.device_count() > rank else 0


def _worker_main(rank: int, kind: str, env: dict, cmds, out):
    os.environ.update(env)
    import torch

    from kvbm import _plan
    from kvbm._core import Worker

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    gen = torch.Generator(device=device)
    gen.manual_seed(3000 + rank)  # every rank's bytes differ

    def rand_bf16(shape):
        # Every 16-bit pattern (NaNs included): compared as raw bytes.
        return torch.randint(-32768, 32768, shape, dtype=torch.int32, device=device,
                             generator=gen).to(torch.int16).view(torch.bfloat16)

    # initialize_kv_cache: the engine allocates and owns the tensors.
    if kind == "flash_attn":  # vLLM: one [2, N, block_size, heads, head_dim] tensor per layer
        layers = [rand_bf16((2, NUM_BLOCKS, BS, HEADS, DIM)) for _ in range(LAYERS)]
    else:  # TensorRT-LLM: one pool [N, layers, K/V, heads × block_size × head_dim]
        layers = [rand_bf16((NUM_BLOCKS, LAYERS, 2, HEADS * BS * DIM))]

    def block_bytes(b: int) -> bytes:
        parts = [t[:, b] for t in layers] if kind == "flash_attn" else [layers[0][b]]
        return torch.cat([p.reshape(-1) for p in parts]).view(torch.int16).cpu().numpy().tobytes()

    def forward(blocks):
        # The engine writes the blocks it is about to save, late on its
        # stream (behind a ~10 ms sleep): the save must wait for it.
        torch.cuda._sleep(20_000_000)
        idx = torch.tensor(blocks, device=device)
        for t in layers:
            if kind == "flash_attn":
                t[:, idx] = rand_bf16((2, len(blocks)) + tuple(t.shape[2:]))
            else:
                t[idx] = rand_bf16((len(blocks),) + tuple(t.shape[1:]))

    tensors = [(t.data_ptr(), list(t.shape), list(t.stride())) for t in layers]
    worker = Worker(tensors=tensors, kind=kind, num_blocks=NUM_BLOCKS, block_size=BS, dtype_bytes=2,
                    rank=rank, num_workers=WORLD, side_channel={"transport": "tcp"})
    out.put(("registered", rank, dev, layers[0].device.index, worker.info()["g1"]))

    saved = {}  # (tier, block) -> the bytes this rank wrote there by a step's save
    saved_g1 = {}  # G1 block -> its bytes when it was last saved
    pending = []  # ((tier, src), G1 dst) of loads not verified yet
    verified, mismatches = 0, []
    while True:
        cmd = cmds.get(timeout=TIMEOUT)
        if cmd[0] == "close":
            break
        # expect: G1 destination -> the G1 block whose saved bytes a load into
        # it must reproduce (G2->G3 moves run inside Go, unseen here).
        _, pickled, scheduled, expect = cmd
        meta = pickle.loads(pickled)
        plan = _plan.decode(meta.plan)
        for copies in plan["loads"].values():
            pending.extend(((st, src), dst) for st, src, _, dst in copies)
        worker.bind(meta.plan)  # bind_connector_metadata
        worker.start_load()  # start_load_kv
        if scheduled:
            forward(sorted({g1 for _, g1, _, _ in plan["saves"]}))
            worker.wait_for_save()
            for _, g1, tier, dst in plan["saves"]:
                saved[(tier, dst)] = saved_g1[g1] = block_bytes(g1)
        loaded, errors = worker.finished()
        if not loaded and pending:
            worker.wait_loads()
            more, more_err = worker.finished()
            loaded, errors = loaded + more, errors + more_err
        if loaded:
            for src, dst in pending:
                want = saved_g1.get(expect[dst]) if dst in expect else saved.get(src)
                if want is not None and block_bytes(dst) == want:
                    verified += 1
                else:
                    mismatches.append((src, dst))
            pending = []
        out.put(("step", rank, sorted(loaded), sorted(errors), verified, mismatches))
    worker.close()
    out.put(("closed", rank))


def _leader_main(env: dict, to_workers, from_workers, results):
    os.environ.update(env)
    from kvbm import _plan
    from kvbm._core import Leader

    leader = None

    def collect(kind):
        return tp_procs.collect(from_workers, kind, WORLD, TIMEOUT, lambda: tp_procs.dead_ranks(leader))

    def wait_info(cond):
        return tp_procs.wait_for(lambda: leader.info(), cond, TIMEOUT)

    res = {"registered": {r: m[2:] for r, m in collect("registered").items()}}
    leader = Leader(block_size=BS, num_workers=WORLD,
                    side_channel={"transport": "tcp", "ping_interval_ms": 100, "suspect_after_ms": 30000,
                                  "broadcast_timeout_ms": TIMEOUT * 1000})
    leader.wait_ready(timeout_s=TIMEOUT)
    sc = leader.info()["side_channel"]
    res["handshake"] = (WORLD, sc["bytes_per_block"], sc["num_device_blocks"], leader.info()["host_blocks"])
    seq = 0

    def engine_step(updates, loaded=(), scheduled=True, expect=None):
        nonlocal seq
        seq += 1
        plan = leader.step(updates, loaded=loaded)
        pickled = pickle.dumps(ConnectorMetadata(plan=plan, seq=seq))
        for q in to_workers:
            q.put(("step", pickled, scheduled, expect or {}))
        return plan, collect("step")

    def load_step(req, tokens, g1_blocks, expect=None):
        n_ext, is_async = leader.match(req, tokens, 0, 0)
        leader.update_after_alloc(req, g1_blocks, n_ext)
        # The request waits for its KV: no forward for it.
        plan, outs = engine_step([], scheduled=False, expect=expect)
        counts = {}
        for o in outs.values():
            for rid in o[2]:
                counts[rid] = counts.get(rid, 0) + 1
        done = sorted(r for r, c in counts.items() if c == WORLD)
        engine_step([], loaded=done, scheduled=False)
        leader.request_finished(req)
        return {
            "match": (n_ext, is_async),
            "tiers": sorted({c[0] for cs in _plan.decode(plan)["loads"].values() for c in cs}),
            "loads": sum(len(cs) for cs in _plan.decode(plan)["loads"].values()),
            "finished": done,
            "verified": {r: o[4] for r, o in outs.items()},
            "mismatches": {r: o[5] for r, o in outs.items()},
            "errors": {r: o[3] for r, o in outs.items()},
        }

    try:
        # "a": nothing cached; its prefill writes G1 blocks 0..5, saved to G2 on both ranks.
        tokens = list(range(7000, 7000 + PROMPT_BLOCKS * BS))
        plan_a, _ = engine_step([["a", tokens, list(range(PROMPT_BLOCKS)), 0, len(tokens), 0, 0, False]])
        leader.request_finished("a")
        res["saves_a"] = len(_plan.decode(plan_a)["saves"])

        # a's step woke the leader's background loop: a's blocks are copied
        # to G3 on both ranks (after a's saves) and registered once both acked.
        info = wait_info(lambda i: i["side_channel"]["committed"] >= 1)
        res["bg_disk_used"] = info["disk_blocks_used"]

        # "b" shares a's prompt: onboarded from G2 (still there) into G1 blocks 20..26.
        res["b"] = load_step("b", tokens + [1, 2, 3], list(range(20, 20 + PROMPT_BLOCKS + 1)))

        # "c" fills G2 (evicting a's copies there); its own G3 moves go out after its step.
        tokens_c = list(range(9000, 9000 + HOST_BLOCKS * BS))
        engine_step([["c", tokens_c, list(range(8, 8 + HOST_BLOCKS)), 0, len(tokens_c), 0, 0, False]])
        leader.request_finished("c")
        res["bg_committed"] = wait_info(lambda i: i["side_channel"]["committed"] >= 2)["side_channel"]["committed"]

        # "e" shares a's prompt again: only G3 has it now; onboarded into G1
        # blocks 24..30, each holding what a's block of the same position saved.
        res["e"] = load_step("e", tokens + [4, 5, 6], list(range(24, 24 + PROMPT_BLOCKS + 1)),
                             expect={24 + i: i for i in range(PROMPT_BLOCKS)})
    finally:
        for q in to_workers:
            q.put(("close",))
        closed = []
        deadline = time.monotonic() + TIMEOUT
        while len(closed) < WORLD and time.monotonic() < deadline:
            try:
                closed.append(from_workers.get(timeout=0.2))
            except queue.Empty:
                pass
        res["closed"] = sorted(m[1] for m in closed if m[0] == "closed")
        leader.close()  # stops its background loop, then its side channel
    results.put(res)


@pytest.mark.parametrize("kind", ["flash_attn", "trtllm"])
def test_tp2_gpu_offload_onboard_per_rank(kind):
    ctx = mp.get_context("spawn")
    pub, ack = _free_ports(2)
    tmp = tempfile.mkdtemp(prefix="kvbm-gpu-tp-")
    env = {
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "python"), os.path.dirname(os.path.abspath(__file__))]),
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(HOST_BLOCKS),
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(DISK_BLOCKS),
        "DYN_KVBM_DISK_CACHE_DIR": tmp,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_LEADER_ZMQ_HOST": "127.0.0.1",
        "DYN_KVBM_LEADER_ZMQ_PUB_PORT": str(pub),
        "DYN_KVBM_LEADER_ZMQ_ACK_PORT": str(ack),
        "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "90",
    }
    to_workers = [ctx.Queue() for _ in range(WORLD)]
    from_workers, results = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=_worker_main, args=(r, kind, env, to_workers[r], from_workers))
               for r in range(WORLD)]
    lp = ctx.Process(target=_leader_main, args=(env, to_workers, from_workers, results))
    procs = workers + [lp]
    try:
        for p in procs:
            p.start()
        res = _result(results, procs, 240)

        for r in range(WORLD):
            dev, tensor_dev, g1 = res["registered"][r]
            assert dev == rank_device(r) and tensor_dev == dev
            assert g1.startswith(f"cuda:{dev} "), f"rank {r}: the copier must use its tensors' device: {g1}"
        bpb = LAYERS * 2 * BS * HEADS * DIM * 2
        assert res["handshake"] == (WORLD, bpb, NUM_BLOCKS, HOST_BLOCKS)
        assert res["saves_a"] == PROMPT_BLOCKS

        b = res["b"]
        assert b["match"] == (PROMPT_BLOCKS * BS, True)
        assert (b["tiers"], b["loads"], b["finished"]) == ([2], PROMPT_BLOCKS, ["b"])
        assert b["errors"] == {0: [], 1: []} and b["mismatches"] == {0: [], 1: []}
        assert b["verified"] == {0: PROMPT_BLOCKS, 1: PROMPT_BLOCKS}, "each rank onboarded its own bytes from G2"

        assert res["bg_disk_used"] == PROMPT_BLOCKS and res["bg_committed"] == 2
        e = res["e"]
        assert e["match"] == (PROMPT_BLOCKS * BS, True)
        assert (e["tiers"], e["loads"], e["finished"]) == ([3], PROMPT_BLOCKS, ["e"]), "a's G2 copies were evicted"
        assert e["errors"] == {0: [], 1: []} and e["mismatches"] == {0: [], 1: []}
        assert e["verified"] == {0: 2 * PROMPT_BLOCKS, 1: 2 * PROMPT_BLOCKS}, "each rank onboarded its own bytes from G3"
        assert res["closed"] == [0, 1]
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
