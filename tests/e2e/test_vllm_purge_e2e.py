"""Purge on a running vLLM engine (CPU backend), through the operator endpoint
as `python -m kvbm purge --salt` reaches it: after purging salt S1, a request
with S1 recomputes (no kvbm hit, G2 and G3 both forgot it) with the same
output, while the same prompt under salt S2 is still served by kvbm."""

import random

import pytest

pytestmark = pytest.mark.e2e

BS = 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


P = prompt(31, 5 * BS + 9)  # 5 full blocks


def by_tag(res):
    return {a["tag"]: a for a in res["actions"]}


def test_purge_salt_on_running_engine(harness, tmp_path):
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_ADMIN_DIR": str(tmp_path / "admin"),
    }
    res = harness({"env": env, "engine": {"num_gpu_blocks_override": 16}, "actions": [
        {"generate": [P], "salt": "s1", "tag": "s1"},
        {"generate": [P], "salt": "s2", "tag": "s2"},
        {"quiesce": True, "tag": "q"},
        # vLLM's own prefix cache goes (it is salted too, and kvbm does not
        # own it); kvbm's tiers stay.
        {"reset": True, "reset_connector": False, "tag": "reset"},
        {"purge": {"salt": "s1"}, "tag": "purge"},
        {"generate": [P], "salt": "s1", "tag": "s1_again"},
        {"generate": [P], "salt": "s2", "tag": "s2_again"},
    ]})
    t = by_tag(res)
    assert t["reset"]["reset"] is True
    purged = t["purge"]["purge"]
    assert purged["host_blocks"] == 5 and purged["disk_blocks"] == 5, purged
    m0 = t["purge"]["metrics"]
    m1 = t["s1_again"]["metrics"]
    m2 = t["s2_again"]["metrics"]
    assert m1["kvbm_matched_tokens"] == m0["kvbm_matched_tokens"], "salt s1 recomputes: no kvbm hit"
    assert m2["kvbm_matched_tokens"] - m1["kvbm_matched_tokens"] == 5 * BS, "salt s2 is still served"
    assert m2.get("kvbm_load_errors", 0) == 0
    assert t["s1_again"]["tokens"] == t["s1"]["tokens"]
    assert t["s2_again"]["tokens"] == t["s2"]["tokens"] == t["s1"]["tokens"]


def test_purge_survives_restart_of_persistent_disk(harness, tmp_path):
    """Engine 1 (persistent G3) caches P under salts s1 and s2, purges s1 and
    exits without another step (its workers never saw the drops); engine 2
    on the same directory recovers s2's blocks and serves them, and s1's
    stay gone (the purge's tombstones), so s1 recomputes."""
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8,
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_PERSIST": "true",
        "DYN_KVBM_ADMIN_DIR": str(tmp_path / "admin"),
    }
    engine = {"num_gpu_blocks_override": 16}
    first = by_tag(harness({"env": env, "engine": engine, "actions": [
        {"generate": [P], "salt": "s1", "tag": "s1"},
        {"generate": [P], "salt": "s2", "tag": "s2"},
        {"quiesce": True, "tag": "q"},
        {"purge": {"salt": "s1"}, "tag": "purge"},
    ]}))
    assert first["q"]["metrics"]["kvbm_disk_blocks_registered"] >= 10, first["q"]["metrics"]
    assert first["purge"]["purge"]["disk_blocks"] == 5, first["purge"]["purge"]
    assert (tmp_path / "kvbm-g3-purged.tomb").exists()

    second = harness({"env": env, "engine": engine, "actions": [
        {"quiesce": True, "tag": "start"},
        {"generate": [P], "salt": "s1", "tag": "s1_again"},
        {"generate": [P], "salt": "s2", "tag": "s2_again"},
    ]})
    t = by_tag(second)
    ms = t["start"]["metrics"]
    assert ms["kvbm_disk_blocks_registered"] == 5, ms
    m1, m2 = t["s1_again"]["metrics"], t["s2_again"]["metrics"]
    assert m1["kvbm_matched_tokens"] == 0, "s1 was purged before the restart: recomputed"
    assert m2["kvbm_matched_tokens"] == 5 * BS, "s2 is recovered from the persistent tier"
    assert m2.get("kvbm_load_errors", 0) == 0
    assert t["s1_again"]["tokens"] == t["s2_again"]["tokens"] == first["s1"]["tokens"]


def test_purge_salt_deletes_its_g4_objects(harness, s3_server, tmp_path):
    """Engine A (G2 + G4) stores P under salts s1 and s2 in the bucket and
    purges s1: the bucket keeps only s2's objects. Engine B, a fresh
    instance on the same bucket, recomputes P under s1 and onboards it from
    G4 under s2, with the same output."""
    from kvbm.testing.s3server import count_objects

    srv, bucket = s3_server, "kvbm-purge"
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 48, "DYN_KVBM_ADMIN_DIR": str(tmp_path / "admin"),
           **srv.env(bucket)}
    engine = {"num_gpu_blocks_override": 16}
    a = by_tag(harness({"env": env, "engine": engine, "actions": [
        {"generate": [P], "salt": "s1", "tag": "s1"},
        {"generate": [P], "salt": "s2", "tag": "s2"},
        {"s3_objects": srv.state_dir, "bucket": bucket, "at_least": 10, "tag": "uploaded"},
        {"purge": {"salt": "s1"}, "tag": "purge"},
    ]}))
    assert a["uploaded"]["reached"] and a["uploaded"]["objects"] == 10, a["uploaded"]
    assert a["purge"]["purge"]["g4_deleted"] == 5, a["purge"]["purge"]
    assert count_objects(srv.state_dir, bucket) == 5, "the bucket holds no object of s1"

    b = by_tag(harness({"env": env, "engine": engine, "actions": [
        {"generate": [P], "salt": "s1", "tag": "s1_again"},
        {"generate": [P], "salt": "s2", "tag": "s2_again"},
    ]}))
    m1, m2 = b["s1_again"]["metrics"], b["s2_again"]["metrics"]
    assert m1["kvbm_matched_tokens"] == 0, "s1 recomputes on another instance"
    assert m2["kvbm_matched_tokens"] == 5 * BS, m2
    assert m2["kvbm_onboard_blocks_obj2h"] == 5, m2
    assert m2.get("kvbm_load_errors", 0) == 0
    assert b["s1_again"]["tokens"] == b["s2_again"]["tokens"] == a["s1"]["tokens"]
