"""G4: the object-storage tier shared by every engine instance, against real
vLLM engines (CPU backend) and a real S3 server (versitygw).

Engines run one after another, as instances of a fleet come and go: each is a
fresh process with its own small G1 and G2 and no G3, all pointed at one
bucket. What one instance computed, the next one onboards from G4.
"""

import os
import random

import pytest

pytestmark = pytest.mark.e2e

BS = 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


P = prompt(11, 12 * BS + 5)  # the long shared prompt: 12 full blocks
Q = prompt(12, 6 * BS + 3)  # served while the store is down
R = prompt(13, 6 * BS + 3)  # served after the store came back
S = prompt(14, 6 * BS + 3)  # its objects get corrupted before another engine loads them


def gen(tag, *prompts, max_tokens=8):
    return {"generate": [list(p) for p in prompts], "tag": tag, "max_tokens": max_tokens}


def by_tag(res):
    return {a["tag"]: a for a in res["actions"]}


def kvbm_env(srv, **extra):
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 48, **srv.env("kvbm-fleet")}
    env.update(extra)
    return env


def test_g4_shared_between_engines(harness, s3_server, tmp_path):
    srv = s3_server
    state = srv.state_dir
    model = {"dir": str(tmp_path / "model-a")}

    # Reference outputs without kvbm.
    ref = by_tag(harness({"kvbm": False, "model": model, "actions": [gen("p", P), gen("r", R)]}))

    # Engine A computes P, keeps serving through an outage (Q), and uploads
    # again once the store is back (R), without a restart.
    a = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [
        gen("p", P),
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 12, "tag": "uploaded"},
        {"s3": "stop", "state": state, "tag": "outage"},
        gen("q", Q),
        {"quiesce": True, "tag": "q_settled"},
        {"s3": "start", "state": state, "tag": "back"},
        {"wait_metric": "kvbm_g4_breaker_open", "at_most": 0, "tag": "healed"},
        gen("r", R),
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 12 + 6, "tag": "r_up"},
    ]}))
    assert a["p"]["tokens"] == ref["p"]["tokens"]
    assert a["uploaded"]["reached"], a["uploaded"]["metrics"]
    mq = a["q_settled"]["metrics"]
    assert len(a["q"]["tokens"][0]) == 8, "the engine kept serving during the outage"
    assert mq["kvbm_g4_upload_drops"] >= 6, mq  # Q's blocks: refused or failed, counted
    assert mq["kvbm_g4_errors"] >= 1, mq
    assert a["healed"]["reached"], a["healed"]["metrics"]
    assert a["r_up"]["reached"], f"uploads did not resume: {a['r_up']['metrics']}"
    assert a["r"]["tokens"] == ref["r"]["tokens"]

    # Engine B: a fresh process, same bucket and model, empty G1/G2: P and R
    # come from G4 (all but each prompt's last block, which the engine must
    # compute), with the same output as without kvbm.
    b = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [gen("p", P), gen("r", R)]}))
    mb = b["r"]["metrics"]
    assert b["p"]["tokens"] == ref["p"]["tokens"]
    assert b["r"]["tokens"] == ref["r"]["tokens"]
    assert mb["kvbm_onboard_blocks_obj2h"] == 11 + 5, mb
    assert mb["kvbm_g4_lookup_hits"] >= 11 + 5, mb
    assert mb["kvbm_load_errors"] == 0, mb
    assert mb["kvbm_offload_blocks_h2obj"] == 0, "B uploads nothing A already stored"

    # A different model shares the bucket and never matches A's blocks.
    c = by_tag(harness({"model": {"dir": str(tmp_path / "model-c"), "seed": 7}, "env": kvbm_env(srv),
                        "actions": [gen("p", P)]}))
    mc = c["p"]["metrics"]
    assert mc["kvbm_onboard_blocks_obj2h"] == 0, mc
    assert mc["kvbm_g4_lookup_hits"] == 0, mc


def test_g4_corrupt_object_recomputed(harness, s3_server, tmp_path):
    srv = s3_server
    model = {"dir": str(tmp_path / "model")}
    ref = by_tag(harness({"kvbm": False, "model": model, "actions": [gen("s", S)]}))
    a = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [
        gen("s", S), {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 6, "tag": "up"}]}))
    assert a["up"]["reached"]
    # Damage every stored object (payload bytes, headers intact).
    root = os.path.join(srv.state_dir, "data", "kvbm-fleet")
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "r+b") as f:
                f.seek(100)
                b = f.read(1)
                if b:
                    f.seek(100)
                    f.write(bytes([b[0] ^ 0xFF]))
                    n += 1
    assert n >= 6
    b = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [gen("s", S)]}))
    mb = b["s"]["metrics"]
    assert b["s"]["tokens"] == ref["s"]["tokens"], "a corrupt object is never served: recomputed"
    assert mb["kvbm_g4_corrupt_objects"] >= 1, mb
    assert mb["kvbm_onboard_blocks_obj2h"] == 0, mb
