"""kvbm's tiers in vLLM's own KV event stream, end to end: vLLM (CPU) with
``--kv-events-config`` and the consolidator off publishes its G1 events and,
through the connector's ``take_events``, kvbm's G2 (CPU), G3 (STORAGE) and
G4 (STORAGE, REMOTE) stores and removals. A router index fed only that
stream, tracking each block's tiers, stays consistent through offload, G1
eviction, G2 eviction into G3, G4 registry eviction and a full reset
(design §7.4)."""

import random

import pytest

from kvbm.testing.ports import free_ports

from router_index import RouterIndex

pytestmark = pytest.mark.e2e

BS = 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def gen(tag, *prompts):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": 4}


def run_workload(harness, tmp_path, env=None, before_settle=()):
    """Four 9-block prompts (36 blocks: G1 holds 16, G2 12, G3 24), two
    re-visits, then reset_prefix_cache(reset_connector=True); returns the
    harness result and the router index fed vLLM's stream, with the events
    seen by (type, medium, locality) and the most kvbm-only blocks known at
    once."""
    (engine_port,) = free_ports(1)
    A, B, C, D = (prompt(s, 9 * BS + 5) for s in (21, 22, 23, 24))
    E = prompt(25, BS // 4)  # shorter than a block: a step that stores nothing
    spec = {
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 12,
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 24,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
            "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false",
            **(env or {}),
        },
        "engine": {"num_gpu_blocks_override": 16},
        "events": {"endpoint": f"tcp://*:{engine_port}"},
        "collect": {"engine": f"tcp://127.0.0.1:{engine_port}"},
        "settle_collectors": 2,
        "actions": [gen("a", A), gen("b", B), gen("c", C), gen("d", D), gen("a2", A), gen("b2", B),
                    *before_settle, {"quiesce": True, "tag": "settle"},
                    # kvbm's moves finished in the background; the next
                    # step's take_events publishes them.
                    gen("flush", E),
                    {"reset": True, "reset_connector": True, "tag": "full-reset"},
                    # The reset's removals and vLLM's AllBlocksCleared go out
                    # with the next steps' output.
                    gen("flush2", E), {"quiesce": True, "tag": "settled-after-reset"}, gen("flush3", E)],
    }
    res = harness(spec)
    acts = {a["tag"]: a for a in res["actions"]}
    assert acts["settle"]["quiesced"] and acts["settled-after-reset"]["quiesced"], "kvbm's counters kept changing"
    assert acts["full-reset"]["reset"], "vLLM reports the reset (engine and kvbm) failed"
    batches = res["collected"]["engine"]
    assert batches, "vLLM published no KV events"

    idx = RouterIndex(per_medium=True)
    seen: dict = {}  # (type, medium, locality) → count
    kvbm_only = 0  # most blocks known at once that only kvbm's tiers held
    for batch in batches:
        assert isinstance(batch, list) and len(batch) >= 2, batch
        for ev in batch[1]:
            assert isinstance(ev, dict), ev
            key = (ev["type"], ev.get("medium"), ev.get("locality"))
            seen[key] = seen.get(key, 0) + 1
            idx.apply(ev)
            kvbm = idx.blocks_in("CPU") | idx.blocks_in("STORAGE") | idx.blocks_in("STORAGE@REMOTE")
            kvbm_only = max(kvbm_only, len(kvbm - idx.blocks_in("GPU")))
    idx.assert_consistent()
    print(f"events by kind: {seen}; kvbm-only blocks at most: {kvbm_only}; stores {idx.stores} removes {idx.removes}")
    for bad in ("panic", "fatal error", "Traceback"):
        assert bad not in res["log"]
    return res, idx, seen, kvbm_only


def test_vllm_event_stream_carries_kvbm_tiers(harness, tmp_path):
    res, idx, seen, kvbm_only = run_workload(harness, tmp_path)
    acts = {a["tag"]: a for a in res["actions"]}

    # The workload did what it is meant to: offload to G2, G1 evictions, G2
    # evictions into G3, G3 stores, and the reset.
    assert seen.get(("BlockStored", "CPU", "LOCAL"), 0) > 0, seen
    assert seen.get(("BlockRemoved", "CPU", "LOCAL"), 0) > 0, seen
    assert seen.get(("BlockStored", "STORAGE", "LOCAL"), 0) > 0, seen
    assert seen.get(("BlockRemoved", "STORAGE", "LOCAL"), 0) > 0, seen
    assert any(t == "BlockRemoved" and m == "GPU" for t, m, _ in seen), f"no G1 eviction: {seen}"
    assert any(t == "AllBlocksCleared" for t, _, _ in seen), seen
    assert kvbm_only > 0, "blocks held only by kvbm's tiers are known to the router"

    # After the reset neither vLLM nor kvbm holds anything, and the router
    # knows nothing that no tier holds.
    after = acts["settled-after-reset"]["metrics"]
    assert after["kvbm_host_blocks_registered"] == 0 and after["kvbm_disk_blocks_registered"] == 0, after
    assert len(idx) == 0, f"router index still holds {len(idx)} blocks after the reset"
    assert not any(loc == "REMOTE" for _, _, loc in seen), "no G4 events without G4"


def test_vllm_event_stream_carries_g4(harness, s3_server, tmp_path):
    """With G4 on (versitygw) and a registry of 20 blocks for 36 uploaded:
    G4 stores and registry evictions in vLLM's stream as STORAGE / REMOTE;
    after the reset the router knows exactly the blocks the registry still
    believes the bucket holds."""
    env = {**s3_server.env("kvbm-events"), "DYN_KVBM_OBJECT_NUM_BLOCKS": 20}
    poke = prompt(26, 8)
    wait = {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 36, "poke": poke, "tag": "uploaded"}
    res, idx, seen, kvbm_only = run_workload(harness, tmp_path, env=env, before_settle=[wait])
    acts = {a["tag"]: a for a in res["actions"]}
    assert acts["uploaded"]["reached"], acts["uploaded"]
    assert acts["full-reset"]["reset"]
    assert seen.get(("BlockStored", "STORAGE", "REMOTE"), 0) >= 36, seen
    assert seen.get(("BlockRemoved", "STORAGE", "REMOTE"), 0) >= 16, "the registry keeps 20 of 36"
    assert seen.get(("BlockStored", "CPU", "LOCAL"), 0) > 0 and seen.get(("BlockStored", "STORAGE", "LOCAL"), 0) > 0
    assert kvbm_only > 0
    # kvbm's reset empties G2 and G3; the bucket keeps its objects and the
    # registry its hashes: the router knows those, and nothing else.
    g4 = idx.blocks_in("STORAGE@REMOTE")
    assert 0 < len(g4) <= 20
    assert set(idx.blocks()) == g4, "after the reset only G4's blocks are known"
