"""kvbm as vLLM's KV connector, against a real vLLM (CPU backend) on a tiny
random model with greedy decoding: the checks Dynamo's own KVBM tests make
(offload, onboard with identical output, G1 eviction, chunked prefill, disk).

Each test starts one engine in a subprocess (kvbm.testing.vllm_harness), so
the G1 size, kvbm tiers and the workload are exactly those written here.
"""

import random

import pytest

pytestmark = pytest.mark.e2e

BS = 32  # vLLM's CPU attention needs a multiple of 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


A = prompt(1, 6 * BS + 7)  # 6 full blocks + a partial one
B = prompt(2, 13 * BS + 3)  # enough to push A out of a 16-block G1
C = prompt(3, 12 * BS + 1)

FORBIDDEN = ("panic", "fatal error", "Failed to parse block_hash", "block_size=0", "Traceback")


def gen(tag, *prompts, max_tokens=8):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": max_tokens}


def assert_clean(log):
    for bad in FORBIDDEN:
        assert bad not in log, f"{bad!r} in engine log"


def by_tag(res):
    return {a["tag"]: a for a in res["actions"]}


def test_offload_onboard_eviction_determinism(harness):
    spec = {
        "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100},
        "engine": {"num_gpu_blocks_override": 16, "disable_log_stats": False},
        "actions": [
            gen("first", A),
            {"reset": True, "tag": "reset1"},
            gen("after_reset", A),
            {"vllm_metric": "vllm:prompt_tokens_cached_by_source", "by": "source", "tag": "by_source"},
            gen("evict_with_b", B),
            gen("a_after_eviction", A),
            gen("b_again", B),
            gen("a_cycle2", A),
            gen("b_cycle2", B),
            gen("a_cycle3", A),
        ],
    }
    res = harness(spec)
    t = by_tag(res)
    m0 = t["first"]["metrics"]
    assert "_error" not in m0, m0
    # First request: write-through offload of every full block (A's prompt and
    # 8 generated tokens fill 6 blocks), nothing to onboard.
    assert m0["kvbm_offload_blocks_d2h"] == 6
    assert m0["kvbm_onboard_blocks_h2d"] == 0
    assert m0["kvbm_matched_tokens"] == 0
    # After vLLM's own prefix cache is reset, the same prompt comes back from G2.
    m1 = t["after_reset"]["metrics"]
    assert m1["kvbm_onboard_blocks_h2d"] == 6
    assert m1["kvbm_matched_tokens"] == 6 * BS
    assert m1["kvbm_offload_blocks_d2h"] == 6, "blocks kvbm already holds are not offloaded again"
    assert t["after_reset"]["tokens"] == t["first"]["tokens"]
    # vLLM's own per-source counter names the tier kvbm loaded from (the
    # connector's get_external_cache_hit_sources): host (G2), every token.
    src = t["by_source"]["vllm_metric"]
    assert src.get("host") == 6 * BS, src
    assert not src.get("external_unspecified"), src
    # B evicts A from G1; A is onboarded from G2 again with identical output.
    m2 = t["evict_with_b"]["metrics"]
    m3 = t["a_after_eviction"]["metrics"]
    assert m3["kvbm_onboard_blocks_h2d"] > m2["kvbm_onboard_blocks_h2d"]
    assert t["a_after_eviction"]["tokens"] == t["first"]["tokens"]
    # Determinism across cycles.
    for tag in ("a_cycle2", "a_cycle3"):
        assert t[tag]["tokens"] == t["first"]["tokens"], tag
    for tag in ("b_again", "b_cycle2"):
        assert t[tag]["tokens"] == t["evict_with_b"]["tokens"], tag
    # The metrics endpoint serves every design §9 name.
    for name in ("kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d", "kvbm_offload_blocks_d2d",
                 "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d", "kvbm_matched_tokens",
                 "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate"):
        assert name in t["a_cycle3"]["metrics"], name
    assert t["a_cycle3"]["metrics"]["kvbm_host_cache_hit_rate"] > 0
    assert_clean(res["log"])


def test_chunked_prefill(harness):
    spec = {
        "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100},
        "engine": {"num_gpu_blocks_override": 16, "max_num_batched_tokens": 64, "enable_chunked_prefill": True},
        "actions": [gen("first", B), {"reset": True, "tag": "reset"}, gen("again", B)],
    }
    res = harness(spec)
    t = by_tag(res)
    assert t["first"]["metrics"]["kvbm_offload_blocks_d2h"] == 13  # 419 prompt + 8 generated tokens
    assert t["again"]["metrics"]["kvbm_onboard_blocks_h2d"] == 13
    assert t["again"]["tokens"] == t["first"]["tokens"]
    assert_clean(res["log"])


def test_disk_tier_and_corrupted_disk_block(harness, tmp_path):
    spec = {
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 200,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        },
        "engine": {"num_gpu_blocks_override": 16},
        "actions": [
            gen("a", A), gen("b", B), gen("c", C),
            {"reset": True, "tag": "reset1"},
            gen("a_from_disk", A),
            {"corrupt_disk": True, "tag": "corrupt"},
            {"reset": True, "tag": "reset2"},
            gen("b_corrupted", B),
        ],
    }
    res = harness(spec)
    t = by_tag(res)
    assert t["c"]["metrics"]["kvbm_offload_blocks_h2d"] > 0  # G2 → G3
    m = t["a_from_disk"]["metrics"]
    assert m["kvbm_onboard_blocks_d2d"] > 0
    assert t["a_from_disk"]["tokens"] == t["a"]["tokens"]
    assert t["corrupt"]["corrupted_files"] >= 1
    # The corrupted blocks are detected, reported to vLLM, recomputed: same output.
    assert t["b_corrupted"]["tokens"] == t["b"]["tokens"]
    assert t["b_corrupted"]["metrics"]["kvbm_load_errors"] > 0
    assert_clean(res["log"])


def test_recorded_calls_and_open_direct_disk_tier(harness, tmp_path):
    """DYN_KVBM_ENABLE_RECORD with vLLM's own objects (Request, KVCacheBlocks,
    SchedulerOutput), and a disk tier opened with O_DIRECT at open
    (DYN_KVBM_DISK_ALLOCATOR_TYPE=open-direct): same outputs, every call on
    one JSON line."""
    import json

    path = tmp_path / "records.jsonl"
    spec = {
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
            "DYN_KVBM_DISK_ALLOCATOR_TYPE": "open-direct",
            "DYN_KVBM_ENABLE_RECORD": "1",
            "DYN_KVBM_RECORD_PATH": str(path),
        },
        "engine": {"num_gpu_blocks_override": 16},
        "actions": [gen("a", A), gen("b", B), {"reset": True, "tag": "reset"}, gen("a_again", A)],
    }
    res = harness(spec)
    t = by_tag(res)
    assert t["a_again"]["tokens"] == t["a"]["tokens"]
    assert t["a_again"]["metrics"]["kvbm_onboard_blocks_d2d"] > 0  # from the disk tier
    assert_clean(res["log"])
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["method"] for r in recs} >= {"get_num_new_matched_tokens", "update_state_after_alloc",
                                           "build_connector_meta", "request_finished"}
    assert not [r for r in recs if "unrecorded" in json.dumps(r.get("inputs"))], "a real vLLM object defeated the summary"
    matched = [r for r in recs if r["method"] == "get_num_new_matched_tokens"]
    assert [m["inputs"]["request"]["num_tokens"] for m in matched] == [len(A), len(B), len(A)]
    assert matched[-1]["output"][0] == 6 * BS
    alloc = [r for r in recs if r["method"] == "update_state_after_alloc"]
    assert all(isinstance(i, int) for a in alloc for g in a["inputs"]["blocks"]["block_ids"] for i in g)
    assert max(len(line) for line in path.read_text().splitlines()) < 64 * 1024, "records stay compact"


def _free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="tensor parallel 2 needs 2 CPU cores")
def test_tensor_parallel_2(harness):
    """vLLM's CPU backend with TP=2: each rank holds its shard of every kvbm block,
    the leader reaches both workers over the side channel, outputs stay identical."""
    pub, ack = _free_ports(2)
    spec = {
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100,
            "DYN_KVBM_LEADER_ZMQ_PUB_PORT": pub,
            "DYN_KVBM_LEADER_ZMQ_ACK_PORT": ack,
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (auto-bind wants a NUMA node per rank)
        },
        "engine": {"num_gpu_blocks_override": 16, "tensor_parallel_size": 2},
        "actions": [
            gen("first", A),
            {"reset": True, "tag": "reset"},
            gen("after_reset", A),
            gen("evict_with_b", B),
            gen("a_after_eviction", A),
        ],
    }
    res = harness(spec)
    t = by_tag(res)
    assert "ZMQ handshake complete" in res["log"]
    assert t["first"]["metrics"]["kvbm_offload_blocks_d2h"] == 6
    assert t["after_reset"]["metrics"]["kvbm_onboard_blocks_h2d"] == 6
    assert t["after_reset"]["tokens"] == t["first"]["tokens"]
    assert t["a_after_eviction"]["metrics"]["kvbm_onboard_blocks_h2d"] > t["evict_with_b"]["metrics"]["kvbm_onboard_blocks_h2d"]
    assert t["a_after_eviction"]["tokens"] == t["first"]["tokens"]
    for bad in ("panic", "fatal error", "Traceback"):
        assert bad not in res["log"]
