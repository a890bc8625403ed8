"""Leader and worker driven from Python through kvbm._core, with numpy arrays
standing in for the engine's KV cache (G1)."""

import numpy as np
import pytest

from kvbm import KvbmConfigError, KvbmError, _native
from kvbm._core import Leader, Worker
from kvbm.testing.vllm_fakes import ConstantList

BS = 16


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "32")
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
    return monkeypatch


def flash_attn_caches(layers=3, blocks=24, heads=2, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, size=(2, blocks, BS, heads, dim), dtype=np.uint16) for _ in range(layers)]


def describe(caches):
    return [(c.ctypes.data, list(c.shape), [s // c.itemsize for s in c.strides]) for c in caches]


def make_pair(caches, kind="flash_attn"):
    worker = Worker(tensors=describe(caches), kind=kind, num_blocks=caches[0].shape[1], block_size=BS,
                    dtype_bytes=caches[0].itemsize)
    bpb = worker.info()["bytes_per_block"]
    leader = Leader(block_size=BS, bytes_per_block=bpb)
    return leader, worker


def run_step(leader, worker, updates, loaded=()):
    plan = leader.step(updates, loaded)
    worker.bind(plan)
    worker.start_load()
    worker.wait_loads()
    worker.wait_for_save()
    return worker.finished()


def block_bytes(caches, b):
    return [c[:, b].tobytes() for c in caches]


def test_offload_then_onboard_into_other_blocks_byte_exact(env):
    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    assert leader.info()["host_blocks"] == 32 == worker.info()["host_blocks"]
    prompt = list(range(100, 100 + 4 * BS + 3))
    assert leader.match("r1", prompt, _native.salt_hash(), 0) == (0, False)
    first = [5, 9, 2, 7, 11]
    run_step(leader, worker, [["r1", prompt, first, 0, len(prompt), 0, 0, False]])
    assert leader.request_finished("r1") is False
    want = [block_bytes(caches, b) for b in first[:4]]

    # A second request with the same prompt: 4 full blocks cached; the whole
    # prompt is not covered (3 extra tokens), so all 4 are matched.
    got, is_async = leader.match("r2", prompt, _native.salt_hash(), 0)
    assert (got, is_async) == (4 * BS, True)
    dst = [20, 3, 17, 14, 1]
    for b in dst:
        for c in caches:
            c[:, b] = 0
    leader.update_after_alloc("r2", dst, got)
    loaded, errors = run_step(leader, worker, [])
    assert loaded == ["r2"] and errors == []
    for i, b in enumerate(dst[:4]):
        assert block_bytes(caches, b) == want[i], f"block {i} differs"
    assert leader.info()["host_hit_blocks"] == 0  # r2 has not finished yet
    leader.request_finished("r2")
    assert leader.info()["host_hit_blocks"] == 4
    worker.close()
    leader.close()


def test_figures_read_without_a_call_follow_the_steps(env):
    """The figures an engine reads every step (Leader.figures,
    Worker.transfer_seq) come from memory Go keeps current: they agree with
    info() and stats() after each step, move only when something did, and
    stay readable after the handles closed."""
    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    assert leader.figures() == {"host_blocks_used": 0, "disk_blocks_used": 0, "degraded": False, "g4": None}
    assert worker.transfer_seq() == 0
    assert not leader.step_needed(), "a fresh leader waits for no step"
    prompt = list(range(3 * BS + 1))
    run_step(leader, worker, [["a", prompt, [1, 2, 3, 4], 0, len(prompt), 0, 0, False]])
    figs, info = leader.figures(), leader.info()
    assert not leader.step_needed(), "no disk tier: nothing queued after the saves"
    assert figs["host_blocks_used"] == info["host_blocks_used"] == 3
    seq = worker.transfer_seq()
    assert seq == sum(d["batches"] for d in worker.stats()["directions"].values()) > 0
    run_step(leader, worker, [])
    assert worker.transfer_seq() == seq, "a step without copies records no batch"
    leader.reset()
    assert leader.step_needed(), "the reset's drops wait for a step (read without a call)"
    run_step(leader, worker, [])
    assert not leader.step_needed()
    assert leader.figures()["host_blocks_used"] == 0 == leader.info()["host_blocks_used"]
    worker.close()
    leader.close()
    assert worker.transfer_seq() == seq and leader.figures()["host_blocks_used"] == 0


def test_salt_isolates_caches(env):
    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    prompt = list(range(3 * BS + 1))
    run_step(leader, worker, [["a", prompt, [1, 2, 3, 4], 0, len(prompt), 0, _native.salt_hash("tenant-a"), False]])
    assert leader.match("b", prompt, _native.salt_hash("tenant-b"), 0) == (0, False)
    assert leader.match("c", prompt, _native.salt_hash("tenant-a"), 0) == (3 * BS, True)


def test_bad_layout_is_a_clear_error(env):
    caches = [np.zeros((2, 24, BS, 2, 8), np.uint16), np.zeros((2, 24, BS, 4, 8), np.uint16)]
    with pytest.raises(KvbmError, match="mixed per-layer KV shapes"):
        make_pair(caches)


def test_no_tier_configured_names_the_variable(monkeypatch):
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB", raising=False)
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_GB", raising=False)
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    with pytest.raises(KvbmConfigError, match="DYN_KVBM_CPU_CACHE_GB"):
        Leader(block_size=BS, bytes_per_block=1024)


def test_invalid_value_names_variable_and_value(env):
    env.setenv("DYN_KVBM_MAX_CONCURRENT_TRANSFERS", "-3")
    with pytest.raises(KvbmConfigError, match=r'DYN_KVBM_MAX_CONCURRENT_TRANSFERS="-3"'):
        Leader(block_size=BS, bytes_per_block=1024)


@pytest.mark.parametrize("allocator", ["default", "open-direct"])
def test_disk_allocator_types_start_a_disk_tier(env, allocator):
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", allocator)
    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    assert worker.info()["disk_blocks"] == 8


def test_unknown_disk_allocator_type_fails_the_worker_at_start(env):
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", "gds")
    caches = flash_attn_caches()
    with pytest.raises(KvbmConfigError, match=r'DYN_KVBM_DISK_ALLOCATOR_TYPE="gds": must be one of default, open-direct'):
        Worker(tensors=describe(caches), kind="flash_attn", num_blocks=caches[0].shape[1], block_size=BS,
               dtype_bytes=caches[0].itemsize)


def test_garbage_plan_is_rejected_not_executed(env):
    caches = flash_attn_caches()
    _, worker = make_pair(caches)
    with pytest.raises(KvbmError, match="decode step plan"):
        worker.bind(b"\xc1garbage")
    assert not _native.is_poisoned()


def test_plan_format_shared_by_go_and_python(env):
    from kvbm import _plan

    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    prompt = list(range(2 * BS + 1))
    plan = leader.step([["p", prompt, [4, 6, 8], 0, len(prompt), 0, 0, False]])
    p = _plan.decode(plan)
    assert [(c[0], c[1], c[2]) for c in p["saves"]] == [(1, 4, 2), (1, 6, 2)]
    # A plan written by Python is executed by the Go worker.
    worker.bind(_plan.encode(seq=p["seq"] + 1, saves=[(1, 8, 2, 30)]))
    worker.wait_for_save()
    # ...and its bytes come back through a Python-written load.
    assert block_bytes(caches, 20) != block_bytes(caches, 8)
    worker.bind(_plan.encode(seq=p["seq"] + 2, loads={"q": [(2, 30, 1, 20)]}))
    worker.start_load()
    worker.wait_loads()
    worker.wait_for_save()
    assert worker.finished() == (["q"], [])
    assert block_bytes(caches, 20) == block_bytes(caches, 8)


@pytest.mark.parametrize("priority, saved", [
    (None, 3),  # no priorities (vLLM): the filter does not apply
    ([80, 80, 10], 2),  # one per new block: the prefix at or above the threshold
    ([10, 80, 80], 0),
    (80, 3),  # one for every new block
    (10, 0),
])
def test_step_row_priority_forms(env, priority, saved):
    from kvbm import _plan

    env.setenv("DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY", "35")
    leader = Leader(block_size=BS, bytes_per_block=1024)
    try:
        prompt = list(range(3 * BS))
        plan = leader.step([["r", prompt, [4, 5, 6], 0, len(prompt), priority, 0, False]])
        assert [c[1] for c in _plan.decode(plan)["saves"]] == [4, 5, 6][:saved]
    finally:
        leader.close()


def test_match_token_cache_gives_the_uncached_result(env):
    """Leader.match keeps a request's converted tokens across calls (vLLM asks
    again on every step a request waits): every answer equals the one of a
    fresh request given the same tokens, as the tokens grow, shrink, change
    in place or come as another list, and as the salt changes."""
    import array

    caches = flash_attn_caches()
    leader, worker = make_pair(caches)
    prompt = list(range(100, 100 + 6 * BS + 3))
    run_step(leader, worker, [["a", prompt, [0, 1, 2, 3, 4, 5, 6], 0, len(prompt), None, 0, False]])
    leader.request_finished("a")
    default, tenant = _native.salt_hash(), _native.salt_hash("tenant-b")
    fresh = iter(range(10**6))

    def uncached(tokens, salt):
        rid = f"u{next(fresh)}"
        got = leader.match(rid, np.array(tokens, dtype=np.uint32), salt, 0)
        leader.request_finished(rid)
        return got

    toks = prompt[: 2 * BS + 1]
    steps = [
        ("first call", lambda: None, default, 2 * BS),
        ("same again", lambda: None, default, 2 * BS),
        ("grown", lambda: toks.extend(prompt[2 * BS + 1: 5 * BS + 1]), default, 5 * BS),
        ("other salt", lambda: None, tenant, 0),
        ("salt back", lambda: None, default, 5 * BS),
        ("first token changed in place", lambda: toks.__setitem__(0, 7), default, 0),
        ("restored", lambda: toks.__setitem__(0, 100), default, 5 * BS),
        ("shrunk in place", lambda: toks.__delitem__(slice(3 * BS + 1, None)), default, 3 * BS),
        ("grown to the whole prompt", lambda: toks.extend(prompt[3 * BS + 1:]), default, 6 * BS),
    ]
    for name, change, salt, want in steps:
        change()
        got = leader.match("w", ConstantList(toks), salt, 0)
        assert got == uncached(toks, salt) == (want, want > 0), name
    other = list(prompt[:4 * BS])
    other[BS + 3] += 1  # another list object, differing in block 1
    assert leader.match("w", other, default, 0) == uncached(other, default) == (BS, True)
    # numpy arrays and uint32 buffers are used in place, lists converted.
    for form in (np.array(prompt, dtype=np.uint32), np.array(prompt, dtype=np.int64),
                 array.array("I", prompt), memoryview(array.array("I", prompt))):
        assert leader.match("w", form, default, 0) == (6 * BS, True), type(form)
    leader.request_finished("w")
    worker.close()
    leader.close()


def test_match_token_cache_converts_only_new_tokens(env, monkeypatch):
    leader = Leader(block_size=BS, bytes_per_block=1024)
    try:
        fromlist_lengths = []
        real_array = _native.array.array

        class Spy(real_array):
            def fromlist(self, lst):
                fromlist_lengths.append(len(lst))
                return super().fromlist(lst)

        monkeypatch.setattr(_native.array, "array", Spy)
        toks = list(range(5 * BS))
        leader.match("r", toks, 0, 0)
        leader.match("r", toks, 0, 0)
        toks.extend(range(3))
        leader.match("r", toks, 0, 0)
        assert fromlist_lengths == [5 * BS, 3]
        leader.match("r", list(toks), 0, 0)  # another object: converted again
        assert fromlist_lengths == [5 * BS, 3, 5 * BS + 3]
    finally:
        leader.close()


def test_match_token_cache_freed_on_finish_and_bounded(env, monkeypatch):
    leader = Leader(block_size=BS, bytes_per_block=1024)
    try:
        toks = list(range(4 * BS))
        for i in range(3):
            leader.match(f"r{i}", toks, 0, 0)
        assert set(leader._token_cache) == {"r0", "r1", "r2"}
        leader.request_finished("r1")
        leader.request_finished("never-matched")
        assert set(leader._token_cache) == {"r0", "r2"}
        monkeypatch.setattr(Leader, "MAX_TOKEN_CACHE", 2)
        leader.match("r3", toks, 0, 0)
        assert set(leader._token_cache) == {"r2", "r3"}  # the oldest dropped
        assert leader.match("r0", toks, 0, 0) == (0, False)  # still answers, converts again
        for rid in ("r0", "r2", "r3"):
            leader.request_finished(rid)
        assert leader._token_cache == {}
    finally:
        leader.close()


def test_list_reader_matches_fromlist_and_falls_back():
    """capi/pylist.c reads CPython lists in place; every list converts as
    array.array.fromlist would, items it cannot read (not exactly an int,
    negative, >= 2**32) go through fromlist, which raises as before."""
    import array

    assert _native._pylist_reader(), f"in-place reader not enabled (layout {_native.pylist_layout()})"
    rng = np.random.default_rng(1)
    base = [int(x) for x in rng.integers(0, 2**32, size=3000)] + [0, 1, 2**30 - 1, 2**30, 2**32 - 1]
    for lst in (base, base[:_native._PYLIST_MIN], base[:10], [],
                base[:700] + [True, np.uint32(9), 2**31] + base[:700]):
        want = array.array("I")
        want.fromlist([int(x) for x in lst])
        assert _native._list_to_u32(list(lst)) == want
    for bad in (-1, 2**32, 2**70):
        with pytest.raises(OverflowError):
            _native._list_to_u32(base[:600] + [bad])


def test_list_reader_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(_native, "_pylist_fn", None)
    monkeypatch.setenv("KVBM_DISABLE_PYLIST_READER", "1")
    assert _native._pylist_reader() is False
    lst = list(range(2000))
    assert _native._list_to_u32(lst).tolist() == lst


def test_worker_fingerprint_separates_models_and_dtypes(env):
    caches = flash_attn_caches()

    def fp(**kw):
        w = Worker(tensors=describe(caches), kind="flash_attn", num_blocks=caches[0].shape[1], block_size=BS,
                   dtype_bytes=caches[0].itemsize, **kw)
        try:
            return w.info()["fingerprint"]
        finally:
            w.close()

    a = fp(model="org/tiny@main", dtype="torch.bfloat16")
    assert len(a) == 32 and a == fp(model="org/tiny@main", dtype="torch.bfloat16")
    assert a != fp(model="org/tiny@v2", dtype="torch.bfloat16")
    assert a != fp(model="org/tiny@main", dtype="torch.float16")
    assert a != fp(model="org/tiny@main", dtype="torch.bfloat16", rank=1, num_workers=2)


def test_step_update_record_encodes_as_the_positional_row():
    import msgpack

    from kvbm._adapter_common import StepUpdate

    rows = [StepUpdate("r1", [1, 2, 3], [4, 5], 0, 3, None, 7, False),
            StepUpdate("r2", [], [6], 16, 1, [80, 10], 2**63 + 5, True)]
    assert msgpack.packb([rows, [], []], use_bin_type=True) == \
        msgpack.packb([[list(r) for r in rows], [], []], use_bin_type=True)
