"""kvbm with vLLM's hybrid KV cache manager on, against a real vLLM (CPU
backend): a tiny Gemma-3-like model whose layers alternate full attention
and a 64-token sliding window, so vLLM gives it two KV cache groups. A
prompt stored from both groups, evicted from G1, comes back from G2 with
the output vLLM computes without kvbm."""

import os
import random

import pytest

pytestmark = pytest.mark.e2e

BS = 32  # vLLM's CPU attention needs a multiple of 32
WINDOW = 2 * BS
MODEL = {"dir": "/tmp/kvbm-tiny-sliding-window", "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2,
         "sliding_window": WINDOW}


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


A = prompt(1, 6 * BS + 7)  # 6 full blocks + a partial one, longer than the window
B = prompt(2, 9 * BS + 3)


def gen(tag, *prompts, max_tokens=8):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": max_tokens}


ACTIONS = [
    gen("first", A),
    {"reset": True, "tag": "reset"},  # vLLM's own prefix cache (G1) forgets A
    gen("a_from_g2", A),
    gen("b", B),
    {"reset": True, "tag": "reset2"},
    gen("a_again", A),
]


def test_sliding_window_model_keeps_hma_and_onboards_from_g2(harness):
    engine = {"num_gpu_blocks_override": 32}
    res = harness({"model": MODEL, "engine": engine, "actions": ACTIONS,
                   "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100}})
    log = res["log"]
    # vLLM kept its hybrid manager: no "Turning off" line, and kvbm's worker
    # registered two groups (with the manager off vLLM makes one group of
    # full-size KV for every layer).
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 KV cache groups (layer groups [0 1 0 1])" in log, log[-4000:]
    assert "kvbm disabled" not in log and "kvbm failed" not in log
    t = {a["tag"]: a for a in res["actions"]}
    m0, m1 = t["first"]["metrics"], t["a_from_g2"]["metrics"]
    assert m0["kvbm_offload_blocks_d2h"] == 6  # A's prompt and 8 generated tokens fill 6 blocks
    assert m1["kvbm_onboard_blocks_h2d"] == 6
    assert m1["kvbm_matched_tokens"] == 6 * BS
    assert t["a_again"]["metrics"]["kvbm_onboard_blocks_h2d"] == 12

    base = harness({"model": MODEL, "engine": engine, "actions": ACTIONS, "kvbm": False})
    assert "Turning off hybrid kv cache manager" not in base["log"]
    b = {a["tag"]: a for a in base["actions"]}
    for tag in ("first", "a_from_g2", "b", "a_again"):
        assert t[tag]["tokens"] == b[tag]["tokens"], tag
    assert t["a_from_g2"]["tokens"] == t["first"]["tokens"]


SSM_MODEL = {"dir": "/tmp/kvbm-tiny-nemotron-h", "hidden": 128, "layers": 8, "heads": 4, "kv_heads": 2,
             "arch": "nemotron_h"}


def test_hybrid_ssm_model_starts_with_hma_and_kvbm_off(harness):
    """A Mamba2 hybrid (NemotronH) without prefix caching: vLLM keeps only
    each request's running state, so kvbm has no prefix to serve. It
    keeps vLLM's hybrid manager on, so the model starts (with the manager
    off vLLM fails: "Failed to promote local KV cache specs to one unified
    type"), turns itself off with a line naming the group kinds, and vLLM
    serves the model with the output it computes without kvbm. (Prefix
    caching is off: with it, vLLM's Mamba2 layers declare a prefill
    checkpoint block, and its CPU SSD kernel returns no intermediate
    states, so vLLM fails with or without a connector; the short-convolution
    hybrid below runs vLLM's mamba prefix caching on CPU.)"""
    engine = {"num_gpu_blocks_override": 64, "enable_prefix_caching": False}
    actions = [gen("a", A), gen("b", B)]
    res = harness({"model": SSM_MODEL, "engine": engine, "actions": actions})
    log = res["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert ("kvbm disabled for this engine: KV cache groups of kind mamba are not served by kvbm here "
            "(this model's groups: mamba, full_attention): with mamba_cache_mode=none (prefix caching off)") in log, \
        log[-4000:]
    assert "kvbm failed" not in log
    base = harness({"model": SSM_MODEL, "engine": engine, "actions": actions, "kvbm": False})
    t = {a["tag"]: a for a in res["actions"]}
    b = {a["tag"]: a for a in base["actions"]}
    assert t["a"]["tokens"] == b["a"]["tokens"] and t["b"]["tokens"] == b["b"]["tokens"]


LFM2_MODEL = {"dir": "/tmp/kvbm-tiny-lfm2", "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2,
              "arch": "lfm2"}


def lp(tag, *prompts, max_tokens=8):
    return dict(gen(tag, *prompts, max_tokens=max_tokens), logprobs=True)


def close(x, y, tol):
    """Two runs' per-token log-probabilities agree within tol."""
    return len(x) == len(y) and all(len(p) == len(q) and all(abs(u - v) <= tol for u, v in zip(p, q))
                                    for p, q in zip(x, y))


# Log-probabilities of the same engine agree to float rounding; another engine
# process (vLLM without kvbm) runs the model on another thread count, about
# 1e-6 apart. Loading the attention layers without the state at the hit's
# boundary moves them by about 4e-3 on this model (measured), so 1e-4 tells.
SAME_LP, OTHER_LP = 1e-5, 1e-4
A_EXT = A[:6 * BS] + prompt(5, 2 * BS + 9)  # A's first 6 blocks, then another continuation
A_HEAD = A[:4 * BS + 5]  # ends inside A, where no state of A was kept


def test_state_space_hybrid_served_from_g2_and_g3_with_its_state(harness, tmp_path):
    """LFM2 (short-convolution state layers beside attention, vLLM's
    MambaSpec with its prefix caching of state, mamba_cache_mode='align'),
    hybrid manager on: kvbm stores each position and, where a step ended on
    a position's last token, the position again with the state layers' state
    there. A re-visit loads the longest stored prefix ending on a state (G2,
    then G3 after G2 evicted it), a longer prompt sharing that prefix loads
    it and computes the rest, and a prompt ending where no state was kept
    loads nothing. Tokens and log-probabilities as vLLM computes them
    without kvbm."""
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 10,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 200,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
    }
    engine = {"num_gpu_blocks_override": 64}
    actions = [
        lp("first", A),
        {"reset": True, "tag": "reset1"},
        lp("a_from_g2", A),
        {"reset": True, "tag": "reset_ext"},
        lp("ext", A_EXT),
        lp("head", A_HEAD),
        lp("b", B), lp("c", C),
        {"reset": True, "tag": "reset2"},
        lp("a_from_disk", A),
    ]
    res = harness({"model": LFM2_MODEL, "engine": engine, "env": env, "actions": actions})
    log = res["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 KV cache groups (layer groups [0 1 0 1])" in log, log[-4000:]
    assert 'group_kinds=[\\"mamba\\" \\"full_attention\\"]' in log  # the fingerprint names the state group
    for bad in ("kvbm disabled", "kvbm failed", "Traceback", "panic"):
        assert bad not in log, bad
    t = {a["tag"]: a for a in res["actions"]}
    m = {k: t[k]["metrics"] for k in t}
    # A's 6 full blocks, and block 5 again with the state after token 192
    # (vLLM ends the prefill step there; its last 5 tokens come next step).
    assert m["first"]["kvbm_offload_blocks_d2h"] == 7, m["first"]
    assert m["a_from_g2"]["kvbm_onboard_blocks_h2d"] == 6
    assert t["a_from_g2"]["num_cached_tokens"] == [6 * BS]
    assert close(t["a_from_g2"]["logprobs"], t["first"]["logprobs"], SAME_LP)
    matched = {k: m[k]["kvbm_matched_tokens"] for k in m}
    assert matched["ext"] - matched["a_from_g2"] == 6 * BS  # A's prefix and its state, then computed
    assert t["ext"]["num_cached_tokens"] == [6 * BS]
    assert matched["head"] == matched["ext"], "a hit without the state at its end"
    assert m["c"]["kvbm_offload_blocks_h2d"] > 0  # G2 -> G3
    assert m["a_from_disk"]["kvbm_onboard_blocks_d2d"] > 0, m["a_from_disk"]
    assert t["a_from_disk"]["num_cached_tokens"] == [6 * BS]
    assert m["a_from_disk"].get("kvbm_load_errors", 0) == 0
    assert close(t["a_from_disk"]["logprobs"], t["first"]["logprobs"], SAME_LP)

    # Without kvbm, ext comes from vLLM's own prefix cache (A's state at 192,
    # no reset before it): vLLM's CPU backend resuming from a cached state
    # gives log-probabilities about 0.07 off its own computation from scratch
    # (same tokens), so a hit is compared with a hit.
    base_actions = [a for a in actions if a.get("tag") != "reset_ext"]
    base = harness({"model": LFM2_MODEL, "engine": engine, "kvbm": False, "actions": base_actions})
    b = {a["tag"]: a for a in base["actions"]}
    assert b["ext"]["num_cached_tokens"] == [6 * BS] and b["head"]["num_cached_tokens"] == [0]
    for tag in ("first", "a_from_g2", "ext", "head", "b", "c", "a_from_disk"):
        assert t[tag]["tokens"] == b[tag]["tokens"], tag
        assert close(t[tag]["logprobs"], b[tag]["logprobs"], OTHER_LP), tag


def test_state_space_hybrid_shares_g4_between_two_engines(harness, s3_server):
    """LFM2 through G4: engine one uploads A's positions and the one with
    its state; a second engine process (empty G1 and G2) loads A's prefix
    ending on that state from the bucket, with vLLM's output."""
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 48, **s3_server.env(BUCKET + "-state"), **PATIENT_LOOKUPS}
    engine = {"num_gpu_blocks_override": 64}
    ref = harness({"model": LFM2_MODEL, "engine": engine, "kvbm": False, "actions": [lp("a", A)]})
    one = harness({"model": LFM2_MODEL, "engine": engine, "env": env, "actions": [
        lp("a", A),
        {"s3_objects": s3_server.state_dir, "bucket": BUCKET + "-state", "at_least": 7, "tag": "uploaded"},
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 7, "poke": POKE, "tag": "counted"},
    ]})
    t1 = {a["tag"]: a for a in one["actions"]}
    assert t1["uploaded"]["reached"] and t1["uploaded"]["objects"] == 7, t1["uploaded"]
    two = harness({"model": LFM2_MODEL, "engine": engine, "env": env, "actions": [lp("a", A)]})
    for res in (one, two):
        assert "Turning off hybrid kv cache manager" not in res["log"]
        for bad in ("kvbm disabled", "kvbm failed", "Traceback", "panic"):
            assert bad not in res["log"], bad
    t2 = {a["tag"]: a for a in two["actions"]}
    m2 = t2["a"]["metrics"]
    g4_lines = [ln for ln in two["log"].splitlines() if "G4" in ln]
    assert m2["kvbm_onboard_blocks_obj2h"] == 6, (m2, g4_lines)
    assert m2.get("kvbm_load_errors", 0) == 0, m2
    assert t2["a"]["num_cached_tokens"] == [6 * BS]
    assert t2["a"]["tokens"] == t1["a"]["tokens"] == ref["actions"][0]["tokens"]
    assert close(t2["a"]["logprobs"], t1["a"]["logprobs"], OTHER_LP)
    assert close(t2["a"]["logprobs"], ref["actions"][0]["logprobs"], OTHER_LP)


C = prompt(3, 8 * BS + 1)


def test_sliding_window_model_disk_tier_and_corrupted_block(harness, tmp_path):
    """G2 → G3 → G1 with two KV cache groups; a corrupted disk block fails
    its request's whole load (vLLM takes failures per request with several
    groups, and raises on block ids), and vLLM recomputes it: same output."""
    spec = {
        "model": MODEL,
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 200,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        },
        "engine": {"num_gpu_blocks_override": 32},
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
    log = res["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 KV cache groups (layer groups [0 1 0 1])" in log
    assert "kvbm failed" not in log and "Traceback" not in log
    t = {a["tag"]: a for a in res["actions"]}
    assert t["c"]["metrics"]["kvbm_offload_blocks_h2d"] > 0  # G2 → G3
    assert t["a_from_disk"]["metrics"]["kvbm_onboard_blocks_d2d"] > 0
    assert t["a_from_disk"]["tokens"] == t["a"]["tokens"]
    assert t["corrupt"]["corrupted_files"] >= 1
    assert t["b_corrupted"]["metrics"]["kvbm_load_errors"] > 0
    assert "vLLM recomputes the whole prompt of 1 request(s)" in log
    assert t["b_corrupted"]["tokens"] == t["b"]["tokens"]


BUCKET = "kvbm-hybrid"
# G4 look-ups against the local server take milliseconds; a loaded host must
# not cut one short (the assertions count the blocks it finds).
PATIENT_LOOKUPS = {"DYN_KVBM_OBJECT_LOOKUP_TIMEOUT_SECS": 30}
POKE = prompt(99, 8)  # a tiny request: keeps the engine stepping (workers report with each step)
# kvbm stores every layer of each position: 4 layers × (K and V) × 32 tokens × 2 KV heads × 32 dims × 4 bytes.
BLOCK_BYTES = 4 * 2 * BS * 2 * 32 * 4


def test_sliding_window_model_shares_g4_between_two_engines(harness, s3_server):
    """Two KV cache groups through G4: engine one computes A and uploads its
    blocks, a second engine process (empty G1 and G2, no G3) loads every
    full block of A from the bucket into both groups' blocks, with vLLM's
    output without kvbm. The group layout is in the objects' fingerprint,
    so both engines (same model, same grouping) share them. Bytes kvbm
    stored for A are counted: its 6 full blocks, every layer."""
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 48, **s3_server.env(BUCKET), **PATIENT_LOOKUPS}
    engine = {"num_gpu_blocks_override": 32}
    ref = harness({"model": MODEL, "engine": engine, "kvbm": False, "actions": [gen("a", A)]})
    one = harness({"model": MODEL, "engine": engine, "env": env, "actions": [
        gen("a", A),
        {"s3_objects": s3_server.state_dir, "bucket": BUCKET, "at_least": 6, "tag": "uploaded"},
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 6, "poke": POKE, "tag": "counted"},
    ]})
    assert "2 KV cache groups (layer groups [0 1 0 1])" in one["log"]
    assert "Turning off hybrid kv cache manager" not in one["log"]
    t1 = {a["tag"]: a for a in one["actions"]}
    assert t1["uploaded"]["reached"] and t1["uploaded"]["objects"] == 6, t1["uploaded"]
    m = t1["a"]["metrics"]
    assert m["kvbm_block_bytes"] == BLOCK_BYTES
    assert m["kvbm_offload_blocks_d2h"] * m["kvbm_block_bytes"] == 6 * BLOCK_BYTES  # A's bytes stored
    two = harness({"model": MODEL, "engine": engine, "env": env, "actions": [gen("a", A)]})
    assert "Turning off hybrid kv cache manager" not in two["log"]
    t2 = {a["tag"]: a for a in two["actions"]}
    m2 = t2["a"]["metrics"]
    assert m2["kvbm_onboard_blocks_obj2h"] == 6, m2
    assert m2["kvbm_load_errors"] == 0, m2
    assert t2["a"]["num_cached_tokens"] == [6 * BS]
    assert t2["a"]["tokens"] == t1["a"]["tokens"] == ref["actions"][0]["tokens"]


W = prompt(4, 6 * BS)  # whole blocks only


def test_whole_block_prompt_loaded_from_kvbm_hits_g1_again(harness):
    """A prompt of whole blocks cached whole, with a sliding-window group:
    kvbm loads all but its last block (vLLM computes that block), and the
    next request for the same prompt is a G1 hit of vLLM's own, with
    nothing loaded from kvbm (loading all but the last token would leave
    vLLM a sliding window one block short of its own hit's, and every
    re-visit would come from kvbm again)."""
    engine = {"num_gpu_blocks_override": 32}
    actions = [gen("first", W), {"reset": True, "tag": "reset"}, gen("loaded", W), gen("g1", W)]
    res = harness({"model": MODEL, "engine": engine, "actions": actions,
                   "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 100}})
    t = {a["tag"]: a for a in res["actions"]}
    assert t["loaded"]["metrics"]["kvbm_onboard_blocks_h2d"] == 5
    assert t["loaded"]["num_cached_tokens"] == [5 * BS]
    assert t["g1"]["metrics"]["kvbm_onboard_blocks_h2d"] == 5, "the re-visit came from kvbm again"
    assert t["g1"]["num_cached_tokens"] == [5 * BS]  # vLLM's own G1 hit (it caps at the last whole block)
    base = harness({"model": MODEL, "engine": engine, "actions": actions, "kvbm": False})
    b = {a["tag"]: a for a in base["actions"]}
    for tag in ("first", "loaded", "g1"):
        assert t[tag]["tokens"] == b[tag]["tokens"], tag


def tier_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("kvbm-g3-") and n.endswith(".tier"))


def test_sliding_window_model_disk_tier_survives_restart(harness, tmp_path):
    """The persistent disk tier with two KV cache groups: engine one stores
    A (both groups' layers of every position) and moves it to G3; a second
    engine on the same directory recovers the file and loads A from G3 into
    each group's blocks (the sliding group only inside its window) with the
    output vLLM computes without kvbm. The same model with the hybrid
    manager off (one group) is another fingerprint: it recovers nothing
    from that file and matches nothing."""
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_PERSIST": "true",
    }
    engine = {"num_gpu_blocks_override": 32}
    first = harness({"model": MODEL, "engine": engine, "env": env,
                     "actions": [gen("a", A), gen("b", B), {"quiesce": True, "tag": "q"}]})
    assert "2 KV cache groups (layer groups [0 1 0 1])" in first["log"]
    t1 = {a["tag"]: a for a in first["actions"]}
    assert t1["q"]["metrics"]["kvbm_offload_blocks_h2d"] >= 6, t1["q"]["metrics"]  # A's blocks G2 → G3
    files = tier_files(tmp_path)
    assert len(files) == 1, os.listdir(tmp_path)

    second = harness({"model": MODEL, "engine": engine, "env": env, "actions": [gen("a_again", A)]})
    log = second["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "2 KV cache groups (layer groups [0 1 0 1])" in log
    assert "kvbm disk tier ready (persistent)" in log
    m = {a["tag"]: a for a in second["actions"]}["a_again"]
    assert m["metrics"]["kvbm_g3_recovered_blocks"] >= 6, m["metrics"]
    assert m["metrics"]["kvbm_onboard_blocks_d2d"] == 6, m["metrics"]
    assert m["metrics"]["kvbm_matched_tokens"] == 6 * BS
    assert m["metrics"].get("kvbm_load_errors", 0) == 0
    assert m["num_cached_tokens"] == [6 * BS]
    assert tier_files(tmp_path) == files

    off = harness({"model": MODEL, "engine": dict(engine, disable_hybrid_kv_cache_manager=True), "env": env,
                   "actions": [gen("a_off", A)]})
    mo = {a["tag"]: a for a in off["actions"]}["a_off"]["metrics"]
    assert mo.get("kvbm_g3_recovered_blocks", 0) == 0, mo
    assert mo["kvbm_onboard_blocks_d2d"] == 0 and mo["kvbm_matched_tokens"] == 0, mo
    assert "persistent tier file of another fingerprint" in off["log"]
    assert files[0] in tier_files(tmp_path)

    base = harness({"model": MODEL, "engine": engine, "kvbm": False, "actions": [gen("a", A)]})
    assert m["tokens"] == t1["a"]["tokens"] == base["actions"][0]["tokens"]
    for res in (first, second, off):
        for bad in ("panic", "fatal error", "Traceback", "kvbm failed", "kvbm disabled"):
            assert bad not in res["log"], bad


def assert_two_groups_on_both_ranks(log):
    """The engine kept vLLM's hybrid manager and both ranks' workers
    registered the model's two groups, with no failure."""
    assert "Turning off hybrid kv cache manager" not in log
    assert log.count("2 KV cache groups (layer groups [0 1 0 1])") >= 2, log[-4000:]
    for bad in ("kvbm disabled", "kvbm failed", "Traceback", "panic"):
        assert bad not in log, bad


def tp2_persistent_env(tmp_path, host_blocks):
    """kvbm's settings for an engine at tensor parallelism 2 with a
    persistent G3 in tmp_path (one OpenMP thread per rank, on its own core)."""
    from kvbm.testing.ports import free_ports

    pub, ack = free_ports(2)
    return {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": host_blocks,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_PERSIST": "true",
        "DYN_KVBM_LEADER_ZMQ_PUB_PORT": pub,
        "DYN_KVBM_LEADER_ZMQ_ACK_PORT": ack,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs 2 CPU cores")
def test_sliding_window_model_tensor_parallel_2_restart(harness, tmp_path):
    """Two KV cache groups at tensor parallelism 2, with the persistent disk
    tier: each rank stores its shard (its KV head) of every layer of each
    position, A moves G2 → G3 over the side channel; a second engine on the
    same directory recovers both ranks' files and loads A from G3 into each
    group's blocks on each rank, with the output vLLM computes at TP=2
    without kvbm."""
    env = tp2_persistent_env(tmp_path, host_blocks=8)
    engine = {"num_gpu_blocks_override": 32, "tensor_parallel_size": 2}
    first = harness({"model": MODEL, "engine": engine, "env": env,
                     "actions": [gen("a", A), gen("b", B), {"quiesce": True, "tag": "q"}]})
    t1 = {a["tag"]: a for a in first["actions"]}
    assert t1["q"]["metrics"]["kvbm_offload_blocks_h2d"] >= 6, t1["q"]["metrics"]
    files = tier_files(tmp_path)
    assert [f[-10:] for f in files] in (["rank0.tier", "rank1.tier"], ["rank1.tier", "rank0.tier"]), files

    second = harness({"model": MODEL, "engine": engine, "env": env, "actions": [gen("a_again", A)]})
    for res in (first, second):
        assert_two_groups_on_both_ranks(res["log"])
    t2 = {a["tag"]: a for a in second["actions"]}
    m = t2["a_again"]["metrics"]
    assert m["kvbm_g3_recovered_blocks"] >= 6, m
    assert m["kvbm_onboard_blocks_d2d"] == 6 and m["kvbm_matched_tokens"] == 6 * BS, m
    assert m.get("kvbm_load_errors", 0) == 0
    assert t2["a_again"]["num_cached_tokens"] == [6 * BS]
    base = harness({"model": MODEL, "engine": engine, "kvbm": False, "actions": [gen("a", A)],
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}})
    assert t2["a_again"]["tokens"] == t1["a"]["tokens"] == base["actions"][0]["tokens"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs 2 CPU cores")
def test_state_space_hybrid_tensor_parallel_2(harness, tmp_path):
    """LFM2 at tensor parallelism 2 (each rank holds its shard of the
    convolution state and its KV head): both ranks store A's positions and
    the one with its state, a re-visit loads them from G2 into each rank's
    blocks, and a second engine on the same persistent G3 directory loads
    them from G3 — with the tokens and log-probabilities vLLM computes at
    TP=2 from scratch."""
    env = tp2_persistent_env(tmp_path, host_blocks=10)
    engine = {"num_gpu_blocks_override": 64, "tensor_parallel_size": 2}
    first = harness({"model": LFM2_MODEL, "engine": engine, "env": env, "actions": [
        lp("first", A), {"reset": True, "tag": "reset"}, lp("a_from_g2", A), {"quiesce": True, "tag": "q"}]})
    second = harness({"model": LFM2_MODEL, "engine": engine, "env": env, "actions": [lp("a_from_g3", A)]})
    for res in (first, second):
        assert_two_groups_on_both_ranks(res["log"])
    t1 = {a["tag"]: a for a in first["actions"]}
    t2 = {a["tag"]: a for a in second["actions"]}
    assert t1["first"]["metrics"]["kvbm_offload_blocks_d2h"] == 7, t1["first"]["metrics"]
    assert t1["a_from_g2"]["metrics"]["kvbm_onboard_blocks_h2d"] == 6
    assert t1["a_from_g2"]["num_cached_tokens"] == [6 * BS]
    m = t2["a_from_g3"]["metrics"]
    assert m["kvbm_onboard_blocks_d2d"] == 6 and m["kvbm_matched_tokens"] == 6 * BS, m
    assert m.get("kvbm_load_errors", 0) == 0, m
    assert t2["a_from_g3"]["num_cached_tokens"] == [6 * BS]
    base = harness({"model": LFM2_MODEL, "engine": engine, "kvbm": False, "actions": [lp("a", A)],
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}})
    ref = base["actions"][0]
    for got in (t1["first"], t1["a_from_g2"], t2["a_from_g3"]):
        assert got["tokens"] == ref["tokens"]
        assert close(got["logprobs"], ref["logprobs"], OTHER_LP)
