"""Persistent disk tier (DYN_KVBM_DISK_PERSIST) through kvbm._core: a second
worker/leader pair on the same directory recovers the first pair's disk
blocks, in process and through the recovered index an engine passes between
processes (docs/persistent-g3.md)."""

import os

import numpy as np

from kvbm import _native
from kvbm._core import Leader, Worker

BS = 16


def caches(seed, layers=2, blocks=16, heads=2, dim=8):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, size=(2, blocks, BS, heads, dim), dtype=np.uint16) for _ in range(layers)]


def describe(cs):
    return [(c.ctypes.data, list(c.shape), [s // c.itemsize for s in c.strides]) for c in cs]


def worker(cs):
    return Worker(tensors=describe(cs), kind="flash_attn", num_blocks=cs[0].shape[1], block_size=BS,
                  dtype_bytes=cs[0].itemsize, model="test/persist", dtype="uint16")


def run_step(leader, w, updates):
    w.bind(leader.step(updates))
    w.start_load()
    w.wait_loads()
    w.wait_for_save()
    return w.finished()


def test_disk_tier_recovered_by_the_next_pair(monkeypatch, tmp_path):
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB", raising=False)
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "32")  # disk only: saves go to G3
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DYN_KVBM_DISK_PERSIST", "true")
    prompt = list(range(7, 7 + 4 * BS + 5))
    g1 = caches(1)
    w = worker(g1)
    assert w.info()["disk_persistent"] is True
    bpb = w.info()["bytes_per_block"]
    leader = Leader(block_size=BS, bytes_per_block=bpb)
    src = [3, 8, 1, 12, 5]
    run_step(leader, w, [["r", prompt, src, 0, len(prompt), 0, 0, False]])
    want = [[c[:, b].tobytes() for c in g1] for b in src[:4]]
    leader.close()
    w.close()
    files = [n for n in os.listdir(tmp_path) if n.startswith("kvbm-g3-")]
    assert len(files) == 1

    # Same process or not, the new leader gets what the new worker recovered
    # by one route: from the engine (restore_disk), never by itself.
    g1b = caches(2)
    w2 = worker(g1b)
    assert w2.info()["disk_recovered_blocks"] == 4
    leader2 = Leader(block_size=BS, bytes_per_block=bpb)
    assert leader2.info()["disk_blocks_used"] == 0
    assert leader2.restore_disk([w2.recovered()]) == 4
    assert leader2.info()["disk_blocks_used"] == 4
    assert leader2.restore_disk([w2.recovered()]) == 0, "a second restore does nothing"
    got, is_async = leader2.match("again", prompt, _native.salt_hash(), 0)
    assert (got, is_async) == (4 * BS, True)
    dst = [10, 2, 15, 6, 0]
    leader2.update_after_alloc("again", dst, got)
    loaded, errors = run_step(leader2, w2, [])
    assert loaded == ["again"] and errors == []
    for i, b in enumerate(dst[:4]):
        assert [c[:, b].tobytes() for c in g1b] == want[i], f"block {i} differs"

    # Another leader (as of another process) gets the index the same way.
    rec = w2.recovered()
    assert rec
    leader3 = Leader(block_size=BS, bytes_per_block=bpb)
    assert leader3.info()["disk_blocks_used"] == 0
    assert leader3.restore_disk([rec]) == 4
    assert leader3.match("third", prompt, _native.salt_hash(), 0) == (4 * BS, True)
    for h in (leader2, leader3, w2):
        h.close()
