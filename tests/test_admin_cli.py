"""The operator endpoint from Python and the CLI (kvbm.admin, python -m kvbm):
a running leader is found in its directory, stats and purges reach it, a
salt's blocks go and another's stay, and a caller without the token is
refused."""

import json
import os
import socket
import subprocess
import sys

import pytest

from kvbm import _native, admin
from kvbm._adapter_common import StepUpdate
from kvbm._core import Leader

BS = 4


@pytest.fixture
def leader(tmp_path, monkeypatch):
    d = tmp_path / "adm"
    monkeypatch.setenv("DYN_KVBM_ADMIN_DIR", str(d))
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "32")
    ld = Leader(block_size=BS, bytes_per_block=64, tier_events=True)
    yield ld, str(d)
    ld.close()


def test_purge_salt_from_python_and_cli(leader):
    ld, d = leader
    assert os.getpid() in admin.endpoints(d)
    prompt = list(range(100, 112))
    ups = [StepUpdate(f"r{k}", prompt, [3 * k, 3 * k + 1, 3 * k + 2], 0, len(prompt), None,
                      _native.salt_hash(salt), False) for k, salt in enumerate(["tenant-a", "tenant-b"])]
    ld.step(ups)
    st = admin.stats(directory=d)
    assert st["block_size"] == BS and st["host_blocks"] == 32 and st["host_registered"] == 6

    ld.take_events()
    res = admin.purge(salt="tenant-a", directory=d)
    assert res["host_blocks"] == 3 and res["disk_blocks"] == 0
    # vLLM's KV event stream (connector/_events.py) reports the removals: exactly salt A's blocks.
    evs, _ = ld.take_events()
    want = set(_native.sequence_hashes(prompt, BS, salt_hash=_native.salt_hash("tenant-a")))
    assert all(e.removed for e in evs) and {e.seq_hash for e in evs} == want and len(evs) == 3
    got, _ = ld.match("again-a", prompt, _native.salt_hash("tenant-a"), 0)
    assert got == 0, "salt A recomputes"
    got, _ = ld.match("again-b", prompt, _native.salt_hash("tenant-b"), 0)
    assert got > 0, "salt B still hits"

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "kvbm", "--dir", d, "stats"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["lifecycle"]["purges"] == 1
    out = subprocess.run([sys.executable, "-m", "kvbm", "--dir", d, "purge", "--all"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["host_blocks"] == 3
    out = subprocess.run([sys.executable, "-m", "kvbm", "--dir", d, "purge", "--prefix-tokens", "1,2"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and "shorter than one block" in out.stderr


def test_bad_requests_and_no_token(leader):
    _, d = leader
    (sock,) = admin.endpoints(d)[os.getpid()]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock))
        s.sendall(b'{"op": "purge", "all": true}\n')
        reply = json.loads(s.makefile().readline())
    assert reply["ok"] is False and "admin: unauthenticated" in reply["error"]
    with pytest.raises(admin.AdminError, match="give salt"):
        admin.purge(directory=d)
    with pytest.raises(admin.AdminError, match="prefix_tokens must be"):
        admin.purge(prefix_tokens=[-1], directory=d)
    with pytest.raises(admin.AdminError, match="no kvbm engine with pid"):
        admin.stats(pid=1, directory=d)


def test_two_leaders_in_one_process(leader):
    ld, d = leader
    other = Leader(block_size=8, bytes_per_block=64)
    try:
        socks = admin.endpoints(d)[os.getpid()]
        assert len(socks) == 2
        with pytest.raises(admin.AdminError, match="several kvbm engines"):
            admin.stats(directory=d)
        assert {admin.stats(socket=str(p))["block_size"] for p in socks} == {BS, 8}
    finally:
        other.close()
    assert len(admin.endpoints(d)[os.getpid()]) == 1, "a closed leader removes its socket"
