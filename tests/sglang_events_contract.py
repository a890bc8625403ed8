"""kvbm's disk tier in an SGLang fleet's KV event stream, against SGLang's
real event classes: SGLang's own ``KVCacheEventRecorder`` records a radix
node's stores and removals (GPU and its HiCache host tier, ``CPU_PINNED``)
and SGLang's own ``ZmqEventPublisher`` publishes them; the backend's
consolidator (kvbm's, started by ``on_host_pools_registered``) subscribes,
merges the disk tier's pages (named by SGLang's event hash of each page key)
and publishes one stream, checked by a router index. Also kvbm's metrics
endpoint with the page store's counters.

Run by tests/test_sglang_backend.py in the SGLang test process.
"""

from __future__ import annotations

import os
import time
import types
import urllib.request
from array import array

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401
sglang = pytest.importorskip("sglang", reason="sglang not installed: .ci/python-deps.sh installs it (--no-deps)")

import zmq  # noqa: E402
from router_index import RouterIndex  # noqa: E402
from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium, ZmqEventPublisher  # noqa: E402
from sglang.srt.mem_cache.events import KVCacheEventRecorder  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64  # noqa: E402
from sglang_contract import PAGE, _no_ambient_kvbm_env, attach, fill, host_pool, storage_config  # noqa: E402,F401

from kvbm.testing.ports import free_ports  # noqa: E402

U64 = (1 << 64) - 1


def radix_node(tokens: list[int]):
    """A radix tree node under the root, as SGLang's tree holds it."""
    root = types.SimpleNamespace(key=RadixKey(array("q")), parent=None, hash_value=[], event_hash_value=None)
    return types.SimpleNamespace(key=RadixKey(array("q", tokens)), parent=root, hash_value=None,
                                 event_hash_value=None)


def page_hash(tokens: list[int]) -> int:
    """The router's hash of a one-page node (SGLang's page key's head)."""
    return hash_str_to_int64(get_storage_hash_str(tokens, None, page_size=PAGE)[0]) & U64


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_disk_tier_joins_sglang_events_and_metrics(tmp_path):
    engine_port, out_port, metrics_port = free_ports(3)
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{engine_port}", bind=True)
    extra = {"kv_events_endpoint": f"tcp://127.0.0.1:{engine_port}",
             "DYN_KVBM_LEADER_ZMQ_PUB_PORT": out_port - 1000, "DYN_KVBM_KV_EVENTS_BIND_HOST": "127.0.0.1",
             "DYN_KVBM_METRICS": "true", "DYN_KVBM_METRICS_HOST": "127.0.0.1", "DYN_KVBM_METRICS_PORT": metrics_port}
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first", extra=extra), pool)
    cons = backend.kvbm_consolidator()
    assert cons is not None and cons.stats()["zmq_endpoint"].endswith(f":{out_port}")

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{out_port}")
    index = RouterIndex()
    recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)
    sent = [0]

    def publish(*records) -> None:
        for fn, medium in records:
            fn(node, medium=medium)
        evs = recorder.take()
        sent[0] += sum(len(e.block_hashes) for e in evs)
        publisher.publish(KVEventBatch(ts=time.time(), events=evs, attn_dp_rank=0))
        wait_for(lambda: cons.stats()["events_in"] >= sent[0] + kvbm_events[0], "the consolidator to read them")

    def drain(into=None) -> None:
        while sub.poll(0):
            (index if into is None else into).apply_zmq_frames(sub.recv_multipart())

    def settled(want: list[int]) -> bool:
        drain()
        return sorted(index.blocks()) == sorted(want)

    tokens = list(range(2000, 2000 + 3 * PAGE))
    node = radix_node(tokens)
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    event_hashes = [hash_str_to_int64(k) & U64 for k in keys]
    kvbm_events = [0]
    try:
        # The slow joiner: until the consolidator is subscribed, SGLang's
        # publisher drops what it sends; probe with an empty batch.
        wait_for(lambda: (publisher.publish(KVEventBatch(ts=time.time(), events=[], attn_dp_rank=0)) or
                          cons.stats()["batches_in"] > 0), "the consolidator's subscription")
        # Our SUB to the consolidator's output joins late too: store probe
        # pages until the latest one's STORE arrives; output is in order, so
        # nothing sent before it can arrive after it.
        probes = RouterIndex()
        for i in range(200):
            probe = list(range(900_000 + i * PAGE, 900_000 + (i + 1) * PAGE))
            node = radix_node(probe)
            publish((recorder.record_store, StorageMedium.GPU))
            end = time.time() + 0.5
            while page_hash(probe) not in probes.blocks() and time.time() < end:
                if sub.poll(50):
                    drain(into=probes)
            if page_hash(probe) in probes.blocks():
                break
        assert probes.blocks(), ("no probe reached our subscriber", cons.stats())

        # 1. SGLang's GPU cache stores the node: three STOREs, under the
        # hashes SGLang's own recorder computed.
        node = radix_node(tokens)
        publish((recorder.record_store, StorageMedium.GPU))
        wait_for(lambda: settled(event_hashes), "the STOREs")
        assert sorted(index.blocks()) == sorted(event_hashes), "SGLang's event hashes are its page keys' heads"
        index.assert_consistent()

        # 2. HiCache backs the pages up to kvbm (L3), then its host tier takes
        # them and the GPU drops them, then the host tier too: the blocks stay
        # announced, kvbm's disk tier holds them.
        host = pool.alloc(3 * PAGE)
        fill(pool, host, seed=21)
        assert backend.batch_set_v1(keys, host) == [True] * 3
        kvbm_events[0] = 3
        publish((recorder.record_store, StorageMedium.CPU))
        publish((recorder.record_remove, StorageMedium.GPU))
        publish((recorder.record_remove, StorageMedium.CPU))
        # Nothing is to change: a REMOVE forwarded by mistake would arrive
        # before a fence sent after it (a page stored, then removed).
        fence = list(range(950_000, 950_000 + PAGE))
        node = radix_node(fence)
        publish((recorder.record_store, StorageMedium.GPU))
        wait_for(lambda: drain() or page_hash(fence) in index.blocks(), "the fence")
        assert sorted(index.blocks()) == sorted(event_hashes + [page_hash(fence)])
        assert index.removes == 0
        publish((recorder.record_remove, StorageMedium.GPU))
        wait_for(lambda: settled(event_hashes), "the fence's REMOVE")

        # 3. kvbm's tier drops them (clear): now no tier holds them.
        backend.clear()
        wait_for(lambda: (drain() or len(index.blocks()) == 0), "the REMOVEs")
        assert index.stores == 3 + 1 and index.removes == 3 + 1  # with the fence's
        index.assert_consistent()
        st = cons.stats()
        assert st["unknown_removes"] == 0 and st["not_forwarded"] == 0

        # kvbm's metrics endpoint: the page store's counters.
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'kvbm_pagestore_puts{pool="kv"} 3' in body, body[-3000:]
        assert 'kvbm_pagestore_pages_used{pool="kv"} 0' in body
    finally:
        sub.close(0)
        ctx.term()
        backend.close()
        publisher.shutdown()


def test_no_consolidator_without_sglang_events(tmp_path):
    """Outside an SGLang scheduler with --kv-events-config (no endpoint), or
    with the consolidator off, none is started."""
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first"), pool)
    assert backend.kvbm_consolidator() is None
    backend.close()
    off = {"kv_events_endpoint": "tcp://127.0.0.1:1", "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false"}
    backend = attach(storage_config(tmp_path, "page_first", extra=off), pool)
    assert backend.kvbm_consolidator() is None
    backend.close()
