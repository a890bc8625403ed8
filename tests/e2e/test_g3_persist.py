"""Persistent disk tier (DYN_KVBM_DISK_PERSIST) with a real vLLM (CPU backend):
a second engine on the same directory serves the first engine's prompt from
the disk tier it left behind; an engine of another model matches nothing and
leaves the first model's file alone (docs/persistent-g3.md)."""

import os
import random

import pytest

from kvbm.testing.ports import free_port, free_ports

pytestmark = pytest.mark.e2e

BS = 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


A = prompt(11, 6 * BS + 7)  # 6 full blocks + a partial one
B = prompt(12, 13 * BS + 3)


def gen(tag, *prompts):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": 8}


def by_tag(res):
    return {a["tag"]: a for a in res["actions"]}


def tier_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("kvbm-g3-") and n.endswith(".tier"))


def test_disk_tier_survives_restart(harness, tmp_path):
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_PERSIST": "true",
    }
    engine = {"num_gpu_blocks_override": 16}
    # Engine 1: A is written through to G2, then moved to G3 while B runs.
    first = harness({"env": env, "engine": engine, "actions": [gen("a", A), gen("b", B), {"quiesce": True, "tag": "q"}]})
    t1 = by_tag(first)
    assert t1["q"]["metrics"]["kvbm_offload_blocks_h2d"] >= 6, t1["q"]["metrics"]
    files = tier_files(tmp_path)
    assert len(files) == 1, os.listdir(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("kvbm-disk-cache-")]

    # Engine 2, same model and directory, with KV events and the
    # consolidator: the recovered blocks are announced (STOREs) before any
    # request, then A is served from G3 first thing.
    out_port = free_port()
    while out_port <= 1000:
        out_port = free_port()
    env2 = dict(env, DYN_KVBM_LEADER_ZMQ_PUB_PORT=out_port - 1000)
    second = harness({"env": env2, "engine": engine, "events": {"endpoint": f"tcp://*:{free_port()}"},
                      "actions": [{"quiesce": True, "tag": "start"}, gen("a_again", A)]})
    t2 = by_tag(second)
    ms = t2["start"]["metrics"]
    assert ms["kvbm_disk_blocks_registered"] >= 6, ms
    assert ms["kvbm_consolidator_events_in"] >= ms["kvbm_g3_recovered_blocks"] >= 6, ms
    assert ms["kvbm_consolidator_events_out"] >= 6, ms
    assert ms["kvbm_onboard_blocks_d2d"] == 0
    m = t2["a_again"]["metrics"]
    assert m["kvbm_g3_recovered_blocks"] >= 6, m
    assert m["kvbm_onboard_blocks_d2d"] == 6, m
    assert m["kvbm_matched_tokens"] == 6 * BS
    assert m.get("kvbm_load_errors", 0) == 0
    assert t2["a_again"]["tokens"] == t1["a"]["tokens"]
    assert "kvbm disk tier ready (persistent)" in second["log"]
    assert tier_files(tmp_path) == files

    # Another model on the same directory: its own file, nothing matched,
    # the first model's file kept (and named in the log).
    other = harness({"env": env, "engine": engine, "model": {"dir": str(tmp_path / "other-model"), "seed": 5},
                     "actions": [gen("a_other", A)]})
    mo = by_tag(other)["a_other"]["metrics"]
    assert mo.get("kvbm_g3_recovered_blocks", 0) == 0, mo
    assert mo["kvbm_onboard_blocks_d2d"] == 0
    assert mo["kvbm_matched_tokens"] == 0
    after = tier_files(tmp_path)
    assert len(after) == 2 and files[0] in after, after
    assert "persistent tier file of another fingerprint" in other["log"]
    for log in (first["log"], second["log"], other["log"]):
        for bad in ("panic", "fatal error", "Traceback"):
            assert bad not in log


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs 2 CPU cores")
def test_disk_tier_survives_restart_tp2(harness, tmp_path):
    """TP=2: each rank keeps its own shard's file; the restarted leader
    registers the blocks both ranks recovered (moves went over the side
    channel, tagged) and A comes back from G3 with identical output."""
    pub, ack = free_ports(2)
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_PERSIST": "true",
        "DYN_KVBM_LEADER_ZMQ_PUB_PORT": pub,
        "DYN_KVBM_LEADER_ZMQ_ACK_PORT": ack,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    engine = {"num_gpu_blocks_override": 16, "tensor_parallel_size": 2}
    first = harness({"env": env, "engine": engine, "actions": [gen("a", A), gen("b", B), {"quiesce": True, "tag": "q"}]})
    t1 = by_tag(first)
    assert t1["q"]["metrics"]["kvbm_offload_blocks_h2d"] >= 6, t1["q"]["metrics"]
    files = tier_files(tmp_path)
    assert [f[-10:] for f in files] in (["rank0.tier", "rank1.tier"], ["rank1.tier", "rank0.tier"]), files

    second = harness({"env": env, "engine": engine, "actions": [gen("a_again", A)]})
    m = by_tag(second)["a_again"]["metrics"]
    assert m["kvbm_g3_recovered_blocks"] >= 6, m
    assert m["kvbm_onboard_blocks_d2d"] == 6, m
    assert m.get("kvbm_load_errors", 0) == 0
    assert by_tag(second)["a_again"]["tokens"] == t1["a"]["tokens"]
    for log in (first["log"], second["log"]):
        for bad in ("panic", "fatal error", "Traceback"):
            assert bad not in log
