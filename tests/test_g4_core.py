"""G4 (object storage) through the C ABI from Python: a leader and a worker
in one process (as TensorRT-LLM runs them), a real S3 server (versitygw),
numpy arrays standing in for the engine's KV cache."""

import time

import msgpack
import numpy as np
import pytest

from kvbm import KvbmError, _native
from kvbm._core import Leader, Worker

BS = 16


@pytest.fixture
def g4_env(monkeypatch, s3_server):
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "32")
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    for k, v in s3_server.env("kvbm-py").items():
        monkeypatch.setenv(k, v)
    return s3_server


def caches(layers=2, blocks=24, heads=2, dim=8):
    rng = np.random.default_rng(3)
    return [rng.integers(0, 2**16, size=(2, blocks, BS, heads, dim), dtype=np.uint16) for _ in range(layers)]


def describe(cs):
    return [(c.ctypes.data, list(c.shape), [s // c.itemsize for s in c.strides]) for c in cs]


def run_step(leader, worker, updates, loaded=(), errors=()):
    plan = leader.step(updates, loaded, errors)
    worker.bind(plan)
    worker.start_load()
    worker.wait_loads()
    worker.wait_for_save()
    return worker.finished()


def until(pred, what, timeout=30):
    end = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def settle(leader, rid, prompt, salt):
    """The match once no G4 lookup is pending (the engine asks again each step)."""
    out = []

    def ask():
        r = leader.match(rid, prompt, salt, 0)
        if r[0] != Leader.PENDING:
            out.append(r)
        return bool(out)

    until(ask, f"{rid}'s G4 lookup")
    return out[0]


def test_upload_report_and_load_back(g4_env):
    cs = caches()
    worker = Worker(tensors=describe(cs), kind="flash_attn", num_blocks=24, block_size=BS, dtype_bytes=2,
                    model="tiny", dtype="uint16")
    winfo = worker.info()
    assert winfo["g4"] is True
    # Rank 0's fingerprint reaches the leader from the engine, in any process layout.
    leader = Leader(block_size=BS, bytes_per_block=winfo["bytes_per_block"], g4_async=True,
                    fingerprint=winfo["fingerprint"])
    salt = _native.salt_hash()
    prompt = list(range(300, 300 + 4 * BS + 5))

    # Nothing stored yet: the lookup runs in the background (PENDING), then misses.
    got, _ = leader.match("r1", prompt, salt, 0)
    assert got == Leader.PENDING
    assert settle(leader, "r1", prompt, salt) == (0, False)

    g1 = [5, 9, 2, 7, 11]
    want = [[c[:, b].tobytes() for c in cs] for b in g1[:4]]
    run_step(leader, worker, [["r1", prompt, g1, 0, len(prompt), None, salt, False]])
    leader.request_finished("r1")

    # The worker reports what it stored; the leader serves its counters.
    acked = []

    def reported():
        rep = worker.g4_report()
        leader.g4_report(rep)
        acked.extend(msgpack.unpackb(rep, raw=False)["acked"] or [])
        return len(acked) >= 4

    until(reported, "4 uploads acknowledged")
    info = leader.info()["g4"]
    assert info["offload_blocks_h2obj"] >= 4

    # Forget G2: the same prompt now comes from G4, through a G2 bounce block,
    # byte-exact into other G1 blocks.
    leader.reset()
    dst = [20, 3, 17, 14, 1]
    for b in dst:
        for c in cs:
            c[:, b] = 0
    got, is_async = settle(leader, "r2", prompt, salt)
    assert (got, is_async) == (4 * BS, True)
    leader.update_after_alloc("r2", dst, got)
    loaded, errors = run_step(leader, worker, [])
    assert loaded == ["r2"] and errors == []
    for i, b in enumerate(dst[:4]):
        assert [c[:, b].tobytes() for c in cs] == want[i], f"block {i} differs"
    assert leader.info()["g4"]["onboard_blocks_obj2h"] >= 4
    leader.request_finished("r2")
    leader.close()
    worker.close()


def test_bad_inputs_are_errors(g4_env):
    cs = caches()
    worker = Worker(tensors=describe(cs), kind="flash_attn", num_blocks=24, block_size=BS, dtype_bytes=2,
                    model="tiny", dtype="uint16")
    leader = Leader(block_size=BS, bytes_per_block=worker.info()["bytes_per_block"])
    with pytest.raises(KvbmError, match="fingerprint"):
        leader.set_g4_fingerprint("not-hex")
    with pytest.raises(KvbmError):
        leader.g4_report(b"\xc1garbage")
    leader.set_g4_fingerprint(worker.info()["fingerprint"])  # rank 0's: G4 lookups start
    leader.set_g4_fingerprint(worker.info()["fingerprint"])  # already known: ignored
    leader.close()
    worker.close()


def test_object_tier_needs_host_tier(monkeypatch, s3_server):
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB", raising=False)
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    for k, v in s3_server.env("kvbm-py").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KvbmError, match="DYN_KVBM_OBJECT_ENABLED"):
        Worker(tensors=describe(caches()), kind="flash_attn", num_blocks=24, block_size=BS, dtype_bytes=2)
