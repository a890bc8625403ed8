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
    "degraded ranks: NULL array of 2^62": """
        leader = Leader(block_size=4, bytes_per_block=64)
        expect_error("kvbm_leader_set_degraded", leader._h, None, 1 << 62, match="invalid rank array")
        expect_error("kvbm_leader_set_degraded", leader._h, None, -1, match="invalid rank array")
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
