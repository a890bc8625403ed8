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


BUCKET = "kvbm-fleet"
POKE = prompt(99, 8)  # a tiny request: keeps the engine stepping (workers report with each step)


def kvbm_env(srv, **extra):
    # A look-up cut short by a loaded host would load fewer blocks than the
    # assertions count: give it far more than the 2 s default.
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 48, "DYN_KVBM_OBJECT_LOOKUP_TIMEOUT_SECS": 30, **srv.env(BUCKET)}
    env.update(extra)
    return env


def stored(srv, n, tag):
    return {"s3_objects": srv.state_dir, "bucket": BUCKET, "at_least": n, "tag": tag}


def corrupt(srv, tokens):
    """Flip one payload byte (headers intact) of each stored object of tokens' full blocks."""
    from kvbm import _native
    from kvbm.testing.s3server import object_files

    names = {f"{h:016x}" for h in _native.sequence_hashes(tokens, BS, salt_hash=_native.salt_hash())}
    n = 0
    for path in object_files(srv.state_dir, BUCKET):
        if os.path.basename(path) in names:
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
            n += 1
    return n


def test_g4_shared_between_engines(harness, s3_server, tmp_path):
    srv = s3_server
    model = {"dir": str(tmp_path / "model-a")}

    # Reference outputs without kvbm.
    ref = by_tag(harness({"kvbm": False, "model": model,
                          "actions": [gen("p", P), gen("q", Q), gen("r", R), gen("s", S)]}))

    # Engine A computes P and S and uploads them, keeps serving through an
    # outage (Q), and uploads again once the store is back (R), without a
    # restart.
    a = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [
        gen("p", P),
        gen("s", S),
        stored(srv, 12 + 6, "uploaded"),
        # The server stores an object before it answers its PUT: stopping it
        # as soon as the objects are on its disk could leave an upload without
        # its answer, counted as dropped and never uploaded again.
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 12 + 6, "poke": POKE, "tag": "uploaded_counted"},
        {"s3": "stop", "state": srv.state_dir, "tag": "outage"},
        gen("q", Q),
        # Every upload of Q fails or is refused while the store is down; the
        # worker's counters reach the leader with each engine step (POKE).
        {"wait_metric": "kvbm_g4_upload_drops", "at_least": 6, "poke": POKE, "tag": "q_dropped"},
        {"s3": "start", "state": srv.state_dir, "tag": "back"},
        # The breakers close by themselves (each store tests the bucket once
        # per cool-down), without a restart of the engine.
        {"wait_metric": "kvbm_g4_breaker_open", "at_most": 0, "poke": POKE, "tag": "healed"},
        gen("r", R),
        stored(srv, 12 + 6 + 6, "r_stored"),
        {"wait_metric": "kvbm_offload_blocks_h2obj", "at_least": 12 + 6 + 6, "poke": POKE, "tag": "counted"},
    ]}))
    for tag in ("p", "s", "r"):
        assert a[tag]["tokens"] == ref[tag]["tokens"], tag
    assert a["uploaded"]["reached"], a["uploaded"]
    assert a["uploaded_counted"]["reached"], a["uploaded_counted"]["metrics"]
    assert a["q"]["tokens"] == ref["q"]["tokens"], "the engine kept serving during the outage"
    mq = a["q_dropped"]["metrics"]
    assert a["q_dropped"]["reached"], mq
    assert mq["kvbm_g4_errors"] >= 1, mq
    assert mq["kvbm_g4_breaker_open"] >= 1, mq
    assert a["healed"]["reached"], a["healed"]["metrics"]
    assert a["r_stored"]["reached"], f"uploads did not resume: {a['r_stored']}"
    assert a["r_stored"]["objects"] == 12 + 6 + 6, "nothing of Q was stored during the outage"
    m = a["counted"]["metrics"]
    assert a["counted"]["reached"], m

    # S's objects are damaged in the bucket (a faulty disk or writer).
    assert corrupt(srv, S) == 6

    # Engine B: a fresh process, same bucket and model, empty G1/G2: every
    # full block of P and R comes from G4 (the partial last block is
    # computed), with the same output as without kvbm. S's corrupt objects
    # are never served: its blocks fail to load and are recomputed.
    b = by_tag(harness({"model": model, "env": kvbm_env(srv), "actions": [
        gen("p", P), gen("r", R), gen("s", S),
        {"wait_metric": "kvbm_g4_corrupt_objects", "at_least": 1, "poke": POKE, "tag": "counted"},
    ]}))
    for tag in ("p", "r", "s"):
        assert b[tag]["tokens"] == ref[tag]["tokens"], tag
    assert b["p"]["num_cached_tokens"] == [12 * BS]
    mr = b["r"]["metrics"]
    assert mr["kvbm_onboard_blocks_obj2h"] == 12 + 6, mr
    assert mr["kvbm_g4_lookup_hits"] >= 12 + 6, mr
    assert mr["kvbm_load_errors"] == 0, mr
    m = b["counted"]["metrics"]
    assert b["counted"]["reached"], m
    assert m["kvbm_load_errors"] >= 1, m
    assert m["kvbm_g4_downloads_verified"] == 12 + 6, m

    # A different model shares the bucket and never matches A's blocks.
    c = by_tag(harness({"model": {"dir": str(tmp_path / "model-c"), "seed": 7}, "env": kvbm_env(srv),
                        "actions": [gen("p", P)]}))
    mc = c["p"]["metrics"]
    assert mc["kvbm_onboard_blocks_obj2h"] == 0, mc
    assert mc["kvbm_g4_lookup_hits"] == 0, mc
    assert c["p"]["num_cached_tokens"] == [0]
