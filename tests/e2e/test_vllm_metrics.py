"""kvbm's series on vLLM's own metrics, against a real vLLM (CPU backend,
whose worker runs in a process of its own): after a re-visit served from
kvbm's host tier, vLLM's Prometheus registry shows the worker's transfers
(offload and onboard) and the scheduler's hits per tier, as reported
through the connector stats interface."""

import random

import pytest

pytestmark = pytest.mark.e2e

BS = 32  # vLLM's CPU attention needs a multiple of 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def gen(tag, *prompts):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": 4}


def test_vllm_metrics_show_kvbm_series(harness):
    A = prompt(21, 6 * BS + 7)
    B = prompt(22, 13 * BS + 3)  # pushes A out of a 16-block G1
    spec = {
        "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100},
        "engine": {"num_gpu_blocks_override": 16, "disable_log_stats": False},
        "actions": [
            gen("a", A), gen("b", B), gen("a_again", A),
            {"vllm_metric": "vllm:kvbm_transfer_blocks", "by": "direction", "tag": "blocks"},
            {"vllm_metric": "vllm:kvbm_transfer_bytes", "by": "direction", "tag": "bytes"},
            {"vllm_metric": "vllm:kvbm_loaded_tokens", "by": "tier", "tag": "loaded"},
            {"vllm_metric": "vllm:kvbm_lookup_tokens", "tag": "lookup"},
            {"vllm_metric": "vllm:kvbm_host_blocks_registered", "tag": "host_blocks"},
        ],
    }
    res = harness(spec)
    t = {a["tag"]: a for a in res["actions"]}
    assert t["a_again"]["tokens"] == t["a"]["tokens"]
    kvbm = t["a_again"]["metrics"]  # kvbm's own port, for comparison
    blocks = t["blocks"]["vllm_metric"]
    assert blocks.get("g1_to_g2") == kvbm["kvbm_offload_blocks_d2h"] > 0, (blocks, kvbm)
    assert blocks.get("g2_to_g1") == kvbm["kvbm_onboard_blocks_h2d"] > 0, (blocks, kvbm)
    assert t["bytes"]["vllm_metric"].get("g2_to_g1", 0) > 0, t["bytes"]
    assert t["loaded"]["vllm_metric"].get("host") == kvbm["kvbm_matched_tokens"] > 0, (t["loaded"], kvbm)
    assert t["lookup"]["vllm_metric"][""] >= len(A) + len(B), t["lookup"]
    assert t["host_blocks"]["vllm_metric"][""] == kvbm["kvbm_host_blocks_registered"] > 0
    assert "Traceback" not in res["log"] and "kvbm failed" not in res["log"]
