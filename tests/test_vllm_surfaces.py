"""kvbm inside vLLM's own surfaces, through vLLM's real classes: its connector
stats (aggregated across worker ranks and with the scheduler's by vLLM's
KVOutputAggregator, serialised as vLLM does, logged and recorded on vLLM's
Prometheus metrics) and its tier events in vLLM's KV event stream (vLLM's
BlockStored / BlockRemoved, under vLLM's block hashes), driven by the fake
vLLM of kvbm.testing.vllm_fakes."""

from __future__ import annotations

import os
import pickle
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvbm.testing.vllm_fakes import FakeRequest, FakeVllm, kv_cache_config, vllm_config  # noqa: E402
from kvbm.vllm_integration.connector import DynamoConnector  # noqa: E402
from kvbm.vllm_integration.connector._stats import KvbmConnectorStats  # noqa: E402
from router_index import RouterIndex  # noqa: E402

BS = 4
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
    return monkeypatch


class HashedRequest(FakeRequest):
    """A request with vLLM's block hashes (sha256 chain, as vLLM's request
    block hasher computes them for prompts without extra keys)."""

    @property
    def block_hashes(self) -> list[bytes]:
        toks, out, parent = list(self.all_token_ids), [], None
        for i in range(len(toks) // BS):
            parent = hash_block_tokens(sha256, parent, toks[i * BS:(i + 1) * BS])
            out.append(parent)
        return out


def make_fake(num_blocks=32, events=False, budget=64):
    init_none_hash(sha256)
    cfg = vllm_config(BS)
    if events:
        cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True, endpoint="", publisher="null")
    kvc = kv_cache_config(num_blocks, BS, LAYERS, HEADS, HEAD_DIM)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, num_blocks, HEADS, BS, HEAD_DIM, dtype=torch.float16)
          for i in range(LAYERS)}
    return FakeVllm(DynamoConnector, cfg, kvc, kv, token_budget=budget)


def prompt(seed, n):
    return [(seed * 131 + i * 17) % 499 + 3 for i in range(n)]


def run_until_loaded(fake, req, timeout=60.0):
    fake.add(req)
    fake.run(timeout=timeout)
    assert not fake.wrong_kv, fake.wrong_kv


# ------------------------------------------------------------------ stats


def revisit(fake, tokens):
    """A prompt stored, then re-visited (G2 → G1 load)."""
    run_until_loaded(fake, HashedRequest("a", tokens))
    run_until_loaded(fake, HashedRequest("b", tokens))
    assert fake.requests == {} and fake.done["b"].external_hits == [4 * BS]


def test_worker_and_scheduler_stats_aggregate_across_ranks(env):
    """A store and a re-visit (G2 → G1 load) on two worker ranks: their
    stats, merged by vLLM's KVOutputAggregator, then with the scheduler's
    as vLLM's scheduler does, and serialised as vLLM sends them to its
    frontend: blocks moved are counted once (rank 0), bytes, seconds and
    batches of both ranks add up, and the scheduler's lookups and hits per
    tier come along."""
    tokens = prompt(1, 4 * BS + 2)
    fake, fake1 = make_fake(), make_fake()
    # The second engine's worker stands for rank 1 of the first (same
    # blocks, its own shard): only its role in the stats differs.
    fake1.worker._worker_side._rank = 1
    try:
        revisit(fake, tokens)
        revisit(fake1, tokens)
        fake1.worker._worker_side._stat_load_errors += 2  # as get_finished counts failed block loads
        w0 = fake.worker.get_kv_connector_stats()
        w1 = fake1.worker.get_kv_connector_stats()
        sched = fake.sched.get_kv_connector_stats()
        assert isinstance(w0, KvbmConnectorStats) and isinstance(sched, KvbmConnectorStats)
        assert fake.worker.get_kv_connector_stats() is None, "a second call reports only what happened since"
        # Called every step: the Go totals are read only after a batch was recorded.
        side = fake.worker._worker_side
        reads = []
        real_stats = side._worker.stats
        side._worker.stats = lambda: reads.append(1) or real_stats()
        assert fake.worker.get_kv_connector_stats() is None and reads == [], "nothing moved: the totals are not read"
        run_until_loaded(fake, HashedRequest("c", prompt(2, 2 * BS + 1)))
        again = fake.worker.get_kv_connector_stats()
        assert reads == [1] and again is not None and again.counter("transfer_blocks", "g1_to_g2") == 2
    finally:
        for f in (fake, fake1):
            f.sched.shutdown()
            f.worker.shutdown()

    assert w0.counter("transfer_blocks", "g1_to_g2") == 4 and w0.counter("transfer_blocks", "g2_to_g1") == 4
    assert w0.counter("transfer_batches", "g1_to_g2") >= 1 and w0.counter("transfer_seconds", "g2_to_g1") > 0
    assert w1.counter("transfer_blocks", "g1_to_g2") == 0, "rank 1 does not count the blocks again"
    w0_bytes = w0.counter("transfer_bytes", "g1_to_g2")
    assert w0_bytes > 0 and w1.counter("transfer_bytes", "g1_to_g2") == w0_bytes
    batches = w0.counter("transfer_batches", "g2_to_g1") + w1.counter("transfer_batches", "g2_to_g1")
    seconds = w0.counter("transfer_seconds", "g2_to_g1") + w1.counter("transfer_seconds", "g2_to_g1")

    outputs = [ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(kv_connector_stats=pickle.loads(
        pickle.dumps(s)))) for s in (w0, w1)]  # workers in other processes: pickled
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs).kv_connector_output.kv_connector_stats
    total = merged.aggregate(sched)  # vLLM's scheduler: worker stats, then the scheduler's
    payload = MsgpackDecoder(SchedulerStats).decode(
        MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=total.to_dict()))).kv_connector_stats
    got = DynamoConnector.build_kv_connector_stats(payload)
    assert got.counter("transfer_blocks", "g1_to_g2") == 4, "blocks come from rank 0 only"
    assert got.counter("transfer_bytes", "g1_to_g2") == 2 * w0_bytes
    assert got.counter("transfer_batches", "g2_to_g1") == batches
    assert got.counter("transfer_seconds", "g2_to_g1") == pytest.approx(seconds)
    assert got.counter("load_errors") == 2
    assert got.counter("loaded_tokens", "host") == 4 * BS and got.counter("hit_blocks", "host") == 4
    assert got.counter("lookup_tokens") == 2 * len(tokens)
    assert got.data["gauges"]["host_blocks_registered"][""] == 4

    summary = got.reduce()
    assert summary["kvbm g1_to_g2 blocks"] == 4 and summary["kvbm host hit tokens"] == 4 * BS
    assert summary["kvbm hit rate %"] == pytest.approx(100.0 * 4 * BS / (2 * len(tokens)), abs=0.01)
    assert summary["kvbm load errors"] == 2
    assert KvbmConnectorStats(data={}).is_empty() and not got.is_empty()
    got.reset()
    assert got.is_empty()


def test_vllm_logs_and_records_kvbm_stats(env, caplog):
    """vLLM's stats logger and Prometheus logger, built for DynamoConnector
    from its kv_transfer_config, take kvbm's stats: the log line names
    kvbm's figures and vLLM's registry has the vllm:kvbm_* series."""
    fake = make_fake()
    try:
        tokens = prompt(2, 3 * BS + 1)
        run_until_loaded(fake, HashedRequest("a", tokens))
        run_until_loaded(fake, HashedRequest("b", tokens))
        stats = fake.worker.get_kv_connector_stats().aggregate(fake.sched.get_kv_connector_stats())
    finally:
        fake.sched.shutdown()
        fake.worker.shutdown()
    cfg = vllm_config(BS)

    logging_ = KVConnectorLogging(cfg.kv_transfer_config)
    logging_.observe(stats.to_dict())
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "kvbm g1_to_g2 blocks=3" in lines[0] and "kvbm host hit tokens=12" in lines[0], lines

    reg = CollectorRegistry()

    def bound(cls):
        class C(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, registry=reg, **k)
        return C

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    prom = Prom(cfg, ["model_name", "engine"], {0: ["m", "0"]})
    assert prom.prom_metrics is not None, "DynamoConnector.build_prom_metrics"
    prom.observe(stats.to_dict(), 0)
    prom.observe(stats.to_dict(), 0)  # a second interval adds up
    value = reg.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("vllm:kvbm_transfer_blocks_total", {**labels, "direction": "g2_to_g1"}) == 6
    assert value("vllm:kvbm_transfer_bytes_total", {**labels, "direction": "g1_to_g2"}) == 2 * stats.counter(
        "transfer_bytes", "g1_to_g2")
    assert value("vllm:kvbm_loaded_tokens_total", {**labels, "tier": "host"}) == 2 * 3 * BS
    assert value("vllm:kvbm_host_blocks_registered", labels) == 3
    # A series another kvbm version sends is skipped, not an error.
    prom.observe({"counters": {"no_such_series": {"": 1}}, "gauges": {}}, 0)


# ----------------------------------------------------------------- events


def decode_stream(batches):
    """vLLM's ZMQ publisher's wire form (msgspec msgpack of KVEventBatch),
    decoded as a router does."""
    import msgpack
    import msgspec

    enc = msgspec.msgpack.Encoder()
    return [msgpack.unpackb(enc.encode(b), raw=False, strict_map_key=False) for b in batches]


def test_tier_events_in_vllm_stream(env):
    """Offload, host (G2) eviction into the disk tier (G3), disk eviction,
    re-visits and a connector reset. Every event kvbm adds to vLLM's stream
    is a vLLM BlockStored / BlockRemoved of medium CPU or STORAGE under the
    block's vLLM hash; fed to a router index that tracks each block's tiers,
    nothing is unknown or duplicated, and it holds exactly what kvbm's tiers
    hold, throughout."""
    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "6")
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "10")
    env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    fake = make_fake(events=True)
    idx = RouterIndex(per_medium=True)
    vllm_hashes: dict = {}  # vLLM's external block hash → tokens of its block
    batches = []

    def drain():
        evs = fake.sched.take_events()
        for ev in evs:
            assert isinstance(ev, (BlockStored, BlockRemoved)), ev
            assert ev.medium in ("CPU", "STORAGE") and ev.locality == "LOCAL"
        if evs:
            batches.append(KVEventBatch(ts=time.time(), events=evs))
            idx.apply_all(decode_stream(batches[-1:]))

    def check_matches_tiers():
        info = fake.sched._leader.info()
        assert len(idx.blocks_in("CPU")) == info["host_blocks_used"]
        assert len(idx.blocks_in("STORAGE")) == info["disk_blocks_used"]

    try:
        prompts = [prompt(s, 3 * BS + 1) for s in range(5)]
        for rnd in range(2):
            for i, p in enumerate(prompts):
                req = HashedRequest(f"r{rnd}-{i}", p)
                for j, h in enumerate(req.block_hashes):
                    vllm_hashes[maybe_convert_block_hash(h)] = tuple(p[j * BS:(j + 1) * BS])
                fake.add(req)
                while not fake.idle():
                    fake.step()
                    drain()
                check_matches_tiers()
                idx.assert_consistent()
        assert idx.removes > 0, "evictions were published"
        stores = [ev for b in batches for ev in b.events if isinstance(ev, BlockStored)]
        assert {ev.medium for ev in stores} == {"CPU", "STORAGE"}
        for ev in stores:
            (h,) = ev.block_hashes
            assert vllm_hashes[h] == tuple(ev.token_ids), "the hash vLLM's own events give these tokens"
            assert ev.block_size == BS
        assert any(ev.parent_block_hash is not None for ev in stores)
        # A block held only by kvbm is known to the router.
        assert idx.blocks_in("STORAGE") - idx.blocks_in("CPU")

        assert fake.sched.reset_cache()
        drain()
        idx.assert_consistent()
        assert len(idx) == 0, "after kvbm's reset the router knows none of its blocks"
        check_matches_tiers()
        assert fake.sched.get_kv_connector_stats().counter("kv_events_unmapped") == 0
    finally:
        fake.sched.shutdown()
        fake.worker.shutdown()


def test_g4_tier_events_in_vllm_stream(env, s3_server):
    """G4 in vLLM's stream: every block uploaded to the bucket is announced
    as medium STORAGE, locality REMOTE (vLLM's object-storage tier) when the
    leader's G4 registry takes it, under its vLLM hash with its tokens, and
    removed when the registry lets it go (LRU, here 8 blocks for 15
    uploaded); G2 evictions and a reset leave the G4 copies known. A router
    index fed only these events stays consistent throughout."""
    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "6")
    env.setenv("DYN_KVBM_OBJECT_NUM_BLOCKS", "8")
    for k, v in s3_server.env("kvbm-events").items():
        env.setenv(k, v)
    fake = make_fake(events=True)
    idx = RouterIndex(per_medium=True)
    vllm_hashes: dict = {}
    remote: list = []  # G4 events, in order

    def drain():
        evs = fake.sched.take_events()
        for ev in evs:
            assert (ev.medium, ev.locality) in {("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")}
            if ev.locality == "REMOTE":
                remote.append(ev)
        if evs:
            idx.apply_all(decode_stream([KVEventBatch(ts=time.time(), events=evs)]))
        idx.assert_consistent()

    try:
        prompts = [prompt(s + 40, 3 * BS + 1) for s in range(5)]  # 15 distinct full blocks
        for i, p in enumerate(prompts):
            req = HashedRequest(f"r{i}", p)
            for j, h in enumerate(req.block_hashes):
                vllm_hashes[maybe_convert_block_hash(h)] = tuple(p[j * BS:(j + 1) * BS])
            fake.add(req)
            while not fake.idle():
                fake.step()
                drain()
        deadline = time.monotonic() + 60
        while sum(isinstance(ev, BlockStored) for ev in remote) < 15:
            assert time.monotonic() < deadline, f"G4 stores announced: {len(remote)} events"
            time.sleep(0.05)
            fake.step()  # the worker's upload acknowledgements reach the leader with a step's output
            drain()
        stores = [ev for ev in remote if isinstance(ev, BlockStored)]
        removes = [ev for ev in remote if isinstance(ev, BlockRemoved)]
        assert len({ev.block_hashes[0] for ev in stores}) == 15
        assert len(removes) == 7, "the registry keeps 8: the 7 least recent leave it"
        for ev in stores:
            assert vllm_hashes[ev.block_hashes[0]] == tuple(ev.token_ids)
        assert any(ev.parent_block_hash is not None for ev in stores)
        g4 = idx.blocks_in("STORAGE@REMOTE")
        assert len(g4) == 8
        assert g4 - idx.blocks_in("CPU"), "blocks held only in G4 are known"

        assert fake.sched.reset_cache()
        drain()
        assert idx.blocks_in("CPU") == set()
        assert set(idx.blocks()) == g4, "after the reset the router knows the G4 blocks only"
        assert fake.sched.get_kv_connector_stats().counter("kv_events_unmapped") == 0
    finally:
        fake.sched.shutdown()
        fake.worker.shutdown()


def test_no_tier_events_without_vllm_kv_events(env):
    fake = make_fake(events=False)
    try:
        run_until_loaded(fake, HashedRequest("a", prompt(3, 3 * BS + 1)))
        assert fake.sched._leader.info()["host_blocks_used"] == 3
        assert fake.sched.take_events() == []
        assert fake.sched._leader.take_events() == ([], 0)
    finally:
        fake.sched.shutdown()
        fake.worker.shutdown()


def test_tier_events_beside_vllm_g1_events(env):
    """vLLM's own G1 events (its real BlockPool, real Requests with vLLM's
    block hasher) and kvbm's, published together as vLLM's scheduler does
    (the KV cache manager's events, then the connector's), through offload,
    G1 eviction, G2 and G3 eviction and a reset of both: every block kvbm
    announces carries the hash vLLM's G1 events gave the same block, and a
    router index tracking each block's tiers stays consistent and keeps
    blocks only kvbm holds."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from kvbm.testing.vllm_fakes import Blocks

    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "6")
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "10")
    env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    fake = make_fake(events=True)  # its connectors; this test drives them itself
    sched, worker = fake.sched, fake.worker
    pool = BlockPool(9, True, BS, enable_kv_cache_events=True)  # 8 usable G1 blocks (block 0 is vLLM's null block)
    idx = RouterIndex(per_medium=True)
    gpu_hashes: set = set()
    kvbm_stores = kvbm_only = 0

    def publish():
        nonlocal kvbm_stores
        evs = list(pool.take_events()) + list(sched.take_events())
        if not evs:
            return
        for ev in evs:
            if isinstance(ev, BlockStored) and ev.medium == "GPU":
                gpu_hashes.update(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                kvbm_stores += 1
                assert set(ev.block_hashes) <= gpu_hashes, "kvbm's block under vLLM's own hash"
        idx.apply_all(decode_stream([KVEventBatch(ts=time.time(), events=evs)]))
        idx.assert_consistent()

    def step(so):
        meta = sched.build_connector_meta(so)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        _, recving = worker.get_finished(set(so.finished_req_ids))
        worker.clear_connector_metadata()
        sched.update_connector_output(SimpleNamespace(finished_recving=recving, invalid_block_ids=set()))

    def new_output(req=None, ids=(), finished=()):
        new = [SimpleNamespace(req_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                               block_ids=(list(ids),), num_computed_tokens=0)] if req is not None else []
        return SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                                                  new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req.request_id: req.num_tokens} if req is not None else {},
            finished_req_ids=set(finished))

    try:
        for i in range(6):
            req = Request(f"r{i}", prompt(40 + i, 3 * BS + 1), SamplingParams(max_tokens=1), None,
                          block_hasher=hasher)
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            blocks = pool.get_new_blocks(4)  # evicts cached G1 blocks of earlier prompts
            ids = [b.block_id for b in blocks]
            sched.update_state_after_alloc(req, Blocks(ids), 0)
            pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
            step(new_output(req, ids))
            publish()
            sched.request_finished(req, ids)
            pool.free_blocks(blocks)
            step(new_output(finished=[req.request_id]))
            publish()
            info = sched._leader.info()
            assert len(idx.blocks_in("CPU")) == info["host_blocks_used"]
            assert len(idx.blocks_in("STORAGE")) == info["disk_blocks_used"]
            kvbm_only = max(kvbm_only, len(set(idx.blocks()) - idx.blocks_in("GPU")))
        assert kvbm_stores > 0 and idx.removes > 0
        assert kvbm_only > 0, "blocks evicted from G1 but held by kvbm stay known to the router"
        assert sched.reset_cache() and pool.reset_prefix_cache()
        publish()
        assert len(idx) == 0
    finally:
        sched.shutdown()
        worker.shutdown()
