"""Misuse of the C ABI: every bad handle or argument is
an error for the caller; the library stays healthy. Each case runs in its own
interpreter, so a regression that poisons the library fails that case alone."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import ctypes
from ctypes import POINTER, byref, c_int64, c_uint8, c_uint32, c_uint64
import kvbm
from kvbm import _native
from kvbm._core import Leader

def expect_error(name, *args, match):
    try:
        _native.call(name, *args)
    except kvbm.KvbmError as e:
        assert match in str(e), e
    else:
        raise AssertionError(name + " accepted bad arguments")
    assert not _native.is_poisoned(), "library poisoned by " + name

info = lambda h: ("kvbm_leader_info", h, byref(POINTER(c_uint8)()), byref(c_int64()))
buf_out = lambda: (byref(POINTER(c_uint8)()), byref(c_int64()))
HUGE = 1 << 62  # a garbage length: a Go slice this long panics, a smaller one reads past the array


def make_worker(**kw):
    import numpy as np
    from kvbm._core import Worker
    cache = np.zeros((2, 8, 4, 2, 8), dtype=np.uint16)
    w = Worker(tensors=[(cache.ctypes.data, list(cache.shape), [s // 2 for s in cache.strides])],
               kind="flash_attn", num_blocks=8, block_size=4, dtype_bytes=2, **kw)
    w._keep = cache
    return w
"""

CASES = {
    "unknown handle": """
        expect_error(*info(987654321), match="unknown or already freed")
    """,
    "freed handle": """
        leader = Leader(block_size=4, bytes_per_block=64)
        h = leader._h
        leader.close()
        expect_error(*info(h), match="unknown or already freed")
    """,
    "handle of another kind": """
        leader = Leader(block_size=4, bytes_per_block=64)
        expect_error("kvbm_worker_info", leader._h, byref(POINTER(c_uint8)()), byref(c_int64()), match="is not a")
    """,
    "router hashes with a negative count": """
        out = (c_uint64 * 4)()
        toks = (c_uint32 * 4)()
        expect_error("kvbm_router_hashes", toks, -64, 4, None, out, 4, byref(c_int64()), match="invalid token array")
    """,
    "router hashes with NULL tokens": """
        out = (c_uint64 * 4)()
        expect_error("kvbm_router_hashes", None, 16, 4, None, out, 4, byref(c_int64()), match="invalid token array")
    """,
    "sequence hashes: bad token arrays and output count": """
        out = (c_uint64 * 4)()
        toks = (c_uint32 * 16)()
        for n, t in ((-1, toks), (16, None), (HUGE, toks)):
            expect_error("kvbm_sequence_hashes", t, n, 4, 0, out, 4, byref(c_int64()), match="invalid token array")
        expect_error("kvbm_sequence_hashes", toks, 16, 4, 0, out, 4, None, match="null output count")
    """,
    "router hashes: huge count and NULL output count": """
        out = (c_uint64 * 4)()
        toks = (c_uint32 * 16)()
        expect_error("kvbm_router_hashes", toks, HUGE, 4, None, out, 4, byref(c_int64()), match="invalid token array")
        expect_error("kvbm_router_hashes", toks, 16, 4, None, out, 4, None, match="null output count")
    """,
    "NULL outputs of constructors and queries": """
        expect_error("kvbm_salt_hash", None, 0, None, 0, None, match="null output")
        expect_error("kvbm_config_check", None, 0, None, None, match="null output pointer")
        expect_error("kvbm_leader_new", b"{}", None, match="null output pointer")
        expect_error("kvbm_worker_new", b"{}", None, match="null output pointer")
        expect_error("kvbm_consolidator_new", b"{}", None, match="null output pointer")
        leader = Leader(block_size=4, bytes_per_block=64)
        expect_error("kvbm_leader_info", leader._h, None, byref(c_int64()), match="null output pointer")
        expect_error("kvbm_leader_info", leader._h, byref(POINTER(c_uint8)()), None, match="null output pointer")
        expect_error("kvbm_leader_wait_ready", leader._h, 1, None, match="null output pointer")
        w = make_worker()
        expect_error("kvbm_worker_info", w._h, None, None, match="null output pointer")
        expect_error("kvbm_worker_finished", w._h, None, byref(c_int64()), match="null output pointer")
    """,
    "leader match: bad tokens, request id, outputs": """
        from ctypes import c_int32
        leader = Leader(block_size=4, bytes_per_block=64)
        toks = (c_uint32 * 16)()
        outs = (byref(c_int64()), byref(c_int32()))
        for n, t in ((16, None), (HUGE, toks)):
            expect_error("kvbm_leader_match", leader._h, b"r", t, n, 0, 0, *outs, match="invalid token array")
        expect_error("kvbm_leader_match", leader._h, b"r", toks, -1, 0, 0, *outs, match="negative length")
        expect_error("kvbm_leader_match", leader._h, None, toks, 16, 0, 0, *outs, match="null request id")
        expect_error("kvbm_leader_match", leader._h, b"r", toks, 16, 0, 0, None, outs[1], match="null output pointer")
        expect_error("kvbm_leader_match", leader._h, b"r", toks, 16, 0, 0, outs[0], None, match="null output pointer")
        assert leader.match("r", list(range(16)), 0, 0) == (0, False)  # still serving
    """,
    "leader update_after_alloc: bad block ids, request id, count": """
        leader = Leader(block_size=4, bytes_per_block=64)
        ids = (c_int64 * 4)()
        for n, a in ((4, None), (-1, ids), (HUGE, ids)):
            expect_error("kvbm_leader_update_after_alloc", leader._h, b"r", a, n, 0, match="invalid block id array")
        expect_error("kvbm_leader_update_after_alloc", leader._h, None, ids, 4, 0, match="null request id")
        expect_error("kvbm_leader_update_after_alloc", leader._h, b"r", ids, 4, -8, match="negative external")
    """,
    "leader load_sources: request id, count, outputs": """
        leader = Leader(block_size=4, bytes_per_block=64)
        outs = [c_int64() for _ in range(3)]
        refs = [ctypes.byref(o) for o in outs]
        expect_error("kvbm_leader_load_sources", leader._h, None, 4, *refs, match="null request id")
        expect_error("kvbm_leader_load_sources", leader._h, b"r", -1, *refs, match="negative token count")
        expect_error("kvbm_leader_load_sources", leader._h, b"r", 4, refs[0], None, refs[2], match="null output pointer")
        assert leader.load_sources("r", 4) == (0, 0, 0)  # still serving; nothing planned for "r"
    """,
    "leader step: bad update buffer and outputs": """
        leader = Leader(block_size=4, bytes_per_block=64)
        payload = bytes([0x93, 0x90, 0x90, 0x90])  # msgpack [[], [], []]
        for n, b in ((8, None), (-1, payload), (HUGE, payload)):
            expect_error("kvbm_leader_step", leader._h, b, n, *buf_out(), match="invalid update buffer")
        expect_error("kvbm_leader_step", leader._h, payload, len(payload), None, byref(c_int64()),
                     match="null output pointer")
        assert leader.step([]) is not None  # still serving
    """,
    "leader request_finished: NULL request id and output": """
        from ctypes import c_int32
        leader = Leader(block_size=4, bytes_per_block=64)
        expect_error("kvbm_leader_request_finished", leader._h, None, byref(c_int32()), match="null request id")
        expect_error("kvbm_leader_request_finished", leader._h, b"r", None, match="null output pointer")
    """,
    "worker bind: bad plan buffer": """
        w = make_worker()
        for n, b in ((8, None), (-1, b"x" * 8), (HUGE, b"x" * 8)):
            expect_error("kvbm_worker_bind", w._h, b, n, *buf_out(), match="invalid plan buffer")
        expect_error("kvbm_worker_bind", w._h, b"\\x90", 1, None, byref(c_int64()), match="null output pointer")
    """,
    "G4 reports and the recovered index: bad buffers and NULL outputs": """
        leader = Leader(block_size=4, bytes_per_block=64)
        report, index = bytes([0x80]), bytes([0x90])  # msgpack {} and []
        for n, b in ((8, None), (-1, report), (HUGE, report)):
            expect_error("kvbm_leader_g4_report", leader._h, b, n, match="invalid report buffer")
        for n, b in ((8, None), (-1, index), (HUGE, index)):
            expect_error("kvbm_leader_restore_disk", leader._h, b, n, byref(c_int64()),
                         match="invalid recovered-index buffer")
        expect_error("kvbm_leader_restore_disk", leader._h, index, 1, None, match="null output pointer")
        w = make_worker()
        for name in ("kvbm_worker_recovered", "kvbm_worker_g4_report"):
            expect_error(name, w._h, None, byref(c_int64()), match="null output pointer")
            expect_error(name, w._h, byref(POINTER(c_uint8)()), None, match="null output pointer")
        assert leader.match("r", list(range(16)), 0, 0) == (0, False)  # still serving
    """,
    "side channel: a leader not ready refuses calls; bad transport": """
        from ctypes import c_int32
        leader = Leader(block_size=4, side_channel={"transport": "inproc"})
        ready = c_int32(7)
        _native.call("kvbm_leader_wait_ready", leader._h, 1, byref(ready))
        assert ready.value == 0  # no worker: still waiting
        expect_error("kvbm_leader_info", leader._h, *buf_out(), match="not ready")
        expect_error("kvbm_leader_step", leader._h, b"x", 1, *buf_out(), match="not ready")
        expect_error("kvbm_leader_wait_ready", leader._h, 1, None, match="null output pointer")
        leader.close()
        try:
            Leader(block_size=4, side_channel={"transport": "carrier-pigeon"})
            raise AssertionError("bad transport accepted")
        except kvbm.KvbmError as e:
            assert "carrier-pigeon" in str(e), e
        try:
            make_worker(side_channel={"transport": "carrier-pigeon"})
            raise AssertionError("bad transport accepted")
        except kvbm.KvbmError as e:
            assert "carrier-pigeon" in str(e), e
        assert Leader(block_size=4, bytes_per_block=64).match("r", list(range(16)), 0, 0) == (0, False)  # still serving
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_abi_misuse_is_an_error_not_poison(case):
    code = PRELUDE + textwrap.dedent(CASES[case]) + "\nprint('ok')\n"
    env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4"}
    import os

    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout
