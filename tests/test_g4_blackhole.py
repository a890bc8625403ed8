"""A G4 endpoint that accepts connections and never answers (blackholed, or
hung) must not hold the engine's scheduler: the scheduler-side calls return
at once, G4 is off once the bucket check failed, and on when the endpoint
answers. Through the C ABI, against a real S3 server (versitygw) behind a
relay that stays silent until healed."""

import socket
import threading
import time

import pytest

from kvbm import _native
from kvbm._core import Leader

BS = 16
# Generous: a call that waits on the network (a 10 s request timeout before
# the fix) exceeds it; one that does not never comes near it.
JOIN_S = 5


class Blackhole:
    """127.0.0.1 endpoint: accepts and never answers until heal(target); from
    then on new connections are relayed to target."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.target = None
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def heal(self, target):
        self.target = target

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.target is None:
                self.held.append(c)
            else:
                threading.Thread(target=self._relay, args=(c, self.target), daemon=True).start()

    @staticmethod
    def _relay(c, target):
        up = socket.create_connection(target)

        def pump(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(up, c), daemon=True).start()
        pump(c, up)

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def joined(fn, *args):
    """fn(*args) on another thread (ctypes releases the GIL), which must
    finish within JOIN_S."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), f"{fn.__name__} waited on the object store"
    return out[0]


def until(pred, what, timeout=60):
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def blackholed(monkeypatch, s3_server):
    bh = Blackhole()
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "32")
    monkeypatch.delenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", raising=False)
    for k, v in s3_server.env("kvbm-blackhole").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DYN_KVBM_OBJECT_ENDPOINT", f"http://127.0.0.1:{bh.port}")
    yield bh, ("127.0.0.1", s3_server.port)
    bh.close()


def test_scheduler_calls_never_wait_on_a_blackholed_store(blackholed):
    bh, server = blackholed
    leader = joined(lambda: Leader(block_size=BS, bytes_per_block=4096, g4_async=True))
    joined(leader.set_g4_fingerprint, "0123456789abcdef0123456789abcdef")
    salt = _native.salt_hash()
    prompt = list(range(100, 100 + 3 * BS + 1))
    probes = iter(range(10**6))

    def first_answer():
        rid = f"probe-{next(probes)}"
        got = joined(leader.match, rid, prompt, salt, 0)
        leader.request_finished(rid)
        return got

    # Once the bucket check timed out G4 is off: a new request is not kept
    # waiting for a lookup (before that first answer, one may be).
    until(lambda: first_answer() == (0, False), "G4 off")
    assert bh.held, "the bucket check reached the silent endpoint"

    # The endpoint answers: G4 turns on, and a new request's lookup runs.
    bh.heal(server)
    until(lambda: first_answer()[0] == Leader.PENDING, "G4 on")
    leader.close()
