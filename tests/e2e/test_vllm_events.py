"""KV Event Consolidator end to end: vLLM (CPU) publishes its KV events, kvbm's
leader consolidates them with its own G2/G3 events, and a router index fed the
consolidated stream stays consistent over a workload that evicts from every
tier (design §7, §10)."""

import random
import json
import os
import re

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


def test_consolidated_events_with_real_vllm(harness, tmp_path):
    engine_port, out_port = free_ports(2)
    while out_port <= 1000:
        engine_port, out_port = free_ports(2)
    A, B, C, D = (prompt(s, 9 * BS + 5) for s in (11, 12, 13, 14))
    E = prompt(15, BS // 4)
    spec = {
        "env": {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 12,
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 24,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
            "DYN_KVBM_LEADER_ZMQ_PUB_PORT": out_port - 1000,
            "DYN_LOG": "debug",
        },
        "engine": {"num_gpu_blocks_override": 16},
        "events": {"endpoint": f"tcp://*:{engine_port}"},
        "collect": {"consolidated": f"tcp://127.0.0.1:{out_port}", "engine": f"tcp://127.0.0.1:{engine_port}"},
        "actions": [gen("a", A), gen("b", B), gen("c", C), gen("d", D), gen("a2", A), gen("b2", B),
                    {"reset": True, "tag": "reset"}, gen("c2", C), {"quiesce": True, "tag": "settle"},
                    # Then a reset of kvbm too; vLLM publishes its AllBlocksCleared
                    # with the next step's output, so a prompt shorter than one
                    # block (nothing to store) follows.
                    {"reset": True, "reset_connector": True, "tag": "full-reset"},
                    gen("flush", E), {"quiesce": True, "tag": "settled-after-full-reset"}],
    }
    res = harness(spec)
    acts = {a["tag"]: a for a in res["actions"]}
    assert acts["settle"]["quiesced"] and acts["settled-after-full-reset"]["quiesced"], "kvbm's counters kept changing"
    assert acts["full-reset"]["reset"], "vLLM reports the reset (engine and kvbm) failed"
    # This run (both tiers, the consolidator) exports every series the
    # dashboard in deploy/grafana queries.
    scraped = set(acts["settle"]["metrics"])
    wanted = dashboard_metrics()
    assert len(wanted) >= 20, wanted
    assert not wanted - scraped, f"queried by the dashboard but not exported: {sorted(wanted - scraped)}"
    log = res["log"]
    batches = res["collected"]["consolidated"]
    assert batches, "no consolidated events received"
    # Events published before the full reset: the consolidator's counter once
    # the engine-only part had settled (the engine was idle until the reset).
    before_full_reset = int(acts["settle"]["metrics"]["kvbm_consolidator_events_out"])
    stores = removes = clears = n = 0
    clears_before_full_reset = 0
    held_before_full_reset = None
    idx = RouterIndex()
    for batch in batches:
        assert isinstance(batch, list) and len(batch) == 3, batch
        for ev in batch[1]:
            kind = ev[0]
            stores += kind == "BlockStored"
            removes += kind == "BlockRemoved"
            clears += kind == "AllBlocksCleared"
            if n < before_full_reset:
                clears_before_full_reset += kind == "AllBlocksCleared"
            idx.apply(ev)
            n += 1
            if n == before_full_reset:
                held_before_full_reset = len(idx)
    assert n > before_full_reset, "the full reset published nothing"
    assert res["collected"]["engine"], "vLLM published no KV events"

    first = len(re.findall(r"stored in first source", log))
    dedup = len(re.findall(r"DEDUP: Block \d+ \(seq_hash=\d+\) added to source", log))
    last = len(re.findall(r"removed from last source", log))
    partial = len(re.findall(r"still in \d+ source\(s\)", log))
    assert first > 0 and stores == first, (stores, first)
    assert dedup > 0, "kvbm stores of blocks vLLM already announced must be deduplicated"
    assert removes == last, (removes, last)
    # vLLM's reset_prefix_cache() clears G1 only; kvbm still holds blocks, so
    # the engine's AllBlocksCleared becomes REMOVEs of engine-only blocks, not a CLEAR.
    assert clears_before_full_reset == 0, "an engine-only reset must not make the router forget kvbm's blocks"
    assert held_before_full_reset, "after the engine-only reset the router must still know kvbm's blocks"
    engine_kinds = [ev[0] if isinstance(ev, list) else ev.get("type") for b in res["collected"]["engine"] for ev in b[1]]
    assert "AllBlocksCleared" in engine_kinds, "vLLM announced its reset"
    assert "Source Vllm cleared all its blocks" in log
    assert partial > 0, "removal from one of several holders must stay silent"
    # Both kvbm tiers were used and evicted from.
    assert "source KvbmDisk" in log and "source KvbmHost" in log
    # vLLM's reset clears G1 only; the router must not lose kvbm's blocks. Whatever
    # was published must apply cleanly to a router index.
    assert idx.ok, idx.kinds()
    # reset_prefix_cache(reset_connector=True): the engine and kvbm hold
    # nothing, and the router, fed the consolidated stream, knows nothing.
    after = acts["settled-after-full-reset"]["metrics"]
    assert after["kvbm_host_blocks_registered"] == 0 and after["kvbm_disk_blocks_registered"] == 0, after
    assert len(idx) == 0, f"router index still holds {len(idx)} blocks after the full reset"
    assert clears <= 1, clears
    for bad in ("panic", "fatal error", "Failed to parse block_hash", "block_size=0"):
        assert bad not in log


def dashboard_metrics():
    """Every kvbm_* series the Grafana dashboard queries."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "deploy", "grafana", "kvbm.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"]]
    return {m for e in exprs for m in re.findall(r"kvbm_[a-z0-9_]+", e)}
