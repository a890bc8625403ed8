"""kvbm's TensorRT-LLM connector, driven in TensorRT-LLM's per-iteration order
by tests/trtllm_contract.py: the leader here, two worker processes (TP=2),
CPU tensors standing in for each rank's GPU cache."""

from __future__ import annotations

import os
import time

import pytest

from router_index import RouterIndex
from trtllm_contract import (
    APIS,
    Engine,
    FakeLlmRequest,
    InProcessPool,
    RequestData,
    SchedulerOutput,
    WorkerPool,
    make_llm_args,
    saves_of,
    write_model_config,
)

BS = 8
BASE_SPEC = dict(tp=2, bs=BS, layers=4, kv_heads=4, head_dim=16, num_blocks=64)
BASE_ENV = {
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "128",
    "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false",
}


def toks(n, start=100):
    return [start + i for i in range(n)]


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


@pytest.fixture
def make_engine(pool, tmp_path, monkeypatch):
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader
    from kvbm.trtllm_integration.connector._common import LOCAL

    made = []

    def make(env_extra=None, spec_extra=None, workers=None, **engine_kw):
        spec = dict(BASE_SPEC, model_dir=str(tmp_path / "model"))
        spec.update(spec_extra or {})
        write_model_config(spec["model_dir"], spec)
        env = {k: v for k, v in dict(BASE_ENV, **(env_extra or {})).items() if v is not None}
        for k in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        LOCAL.reset()
        wp = workers or pool
        infos = wp.all("init", lambda r: (spec, None if workers else env, r))
        leader = DynamoKVBMConnectorLeader(make_llm_args(spec, 0))
        eng = Engine(leader, wp, spec, **engine_kw)
        eng.infos = infos
        made.append(leader)
        return eng

    yield make
    for leader in made:
        leader.shutdown()


def run_and_onboard(eng, first_prompt, max_new, second_prompt, expect_blocks, device_hit_blocks=0):
    """Run request 1 to completion, then request 2 sharing its prefix; check
    that 2 loads exactly expect_blocks blocks and that every rank's G1 then
    holds the bytes request 1's forward pass wrote."""
    a = eng.submit(FakeLlmRequest(1, first_prompt, max_new))
    eng.run()
    assert a.phase == "done"
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, (r.device_hit + r.matched) // BS), loaded.append(r))
    b = eng.submit(FakeLlmRequest(2, second_prompt, 2), device_hit_blocks=device_hit_blocks)
    eng.run()
    assert b.matched == expect_blocks * BS - b.device_hit
    assert loaded == [b], "the load was never released on every rank"
    assert b.phase == "done"
    return a, b


def test_module_imports_without_tensorrt_llm():
    import kvbm.trtllm_integration.connector as c

    assert c.HAVE_TRTLLM is False
    assert issubclass(c.DynamoKVBMConnectorLeader, c._common.KvCacheConnectorScheduler)
    assert issubclass(c.DynamoKVBMConnectorWorker, c._common.KvCacheConnectorWorker)


# TensorRT-LLM's connector base classes as abstract classes, with the
# abstract methods of its API (restated from its interface).
_FAKE_BASES = """
from abc import ABC, abstractmethod


class KvCacheConnectorScheduler(ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
    @abstractmethod
    def request_finished(self, request, cache_block_ids): ...
    @abstractmethod
    def update_state_after_alloc(self, request, block_ids): ...

    def wait_for_initialization(self):
        return None


class KvCacheConnectorWorker(ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args
        self._metadata = None

    def bind_connector_meta(self, metadata):
        self._metadata = metadata

    def get_connector_meta(self):
        return self._metadata

    def _clear_connector_meta(self):
        self._metadata = None

    def register_forward_pass_callable(self):
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor): ...
    @abstractmethod
    def start_load_kv(self, stream): ...
    @abstractmethod
    def wait_for_layer_load(self, layer_idx, stream): ...
    @abstractmethod
    def save_kv_layer(self, layer_idx, stream): ...
    @abstractmethod
    def wait_for_save(self, stream): ...
    @abstractmethod
    def get_finished(self, finished_gen_req_ids, started_loading_req_ids): ...
"""


@pytest.mark.parametrize("paths, want", [
    (["kv_cache_connector.py"], "tensorrt_llm._torch.pyexecutor.kv_cache_connector"),
    (["connectors/kv_cache_connector.py"], "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"),
], ids=["1.2", "main"])
def test_connector_subclasses_the_engine_bases_at_either_module_path(tmp_path, paths, want):
    """1.2 ships the bases in pyexecutor/kv_cache_connector.py, newer releases
    in pyexecutor/connectors/: the connector classes derive from whichever is
    installed and implement every abstract method (TensorRT-LLM instantiates
    them)."""
    import subprocess
    import sys

    root = tmp_path / "tensorrt_llm" / "_torch" / "pyexecutor"
    (root / "connectors").mkdir(parents=True)
    for d in (tmp_path / "tensorrt_llm", tmp_path / "tensorrt_llm" / "_torch", root, root / "connectors"):
        (d / "__init__.py").write_text("")
    for rel in paths:
        (root / rel).write_text(_FAKE_BASES)
    check = (
        "import kvbm.trtllm_integration.connector as c\n"
        "from kvbm.trtllm_integration.connector import _common\n"
        f"assert _common.BASE_MODULE == {want!r}, _common.BASE_MODULE\n"
        "import importlib\n"
        "base = importlib.import_module(_common.BASE_MODULE)\n"
        "assert issubclass(c.DynamoKVBMConnectorLeader, base.KvCacheConnectorScheduler)\n"
        "assert issubclass(c.DynamoKVBMConnectorWorker, base.KvCacheConnectorWorker)\n"
        "for cls in (c.DynamoKVBMConnectorLeader, c.DynamoKVBMConnectorWorker):\n"
        "    assert not cls.__abstractmethods__, (cls.__name__, sorted(cls.__abstractmethods__))\n"
        "assert c.DynamoKVBMConnectorLeader.wait_for_initialization is not base.KvCacheConnectorScheduler.wait_for_initialization\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.parametrize("change, setting", [
    (dict(pp=2), "pipeline_parallel_size=2"),
    (dict(max_beam_width=4), "max_beam_width=4"),
    (dict(host_cache_size=1 << 30), "kv_cache_config.host_cache_size"),
    (dict(policy="MAX_UTILIZATION"), "capacity_scheduler_policy=MAX_UTILIZATION"),
    (dict(kv_cache_manager_v2=True), "kv_cache_config.use_kv_cache_manager_v2=True"),
])
def test_unsupported_settings_are_rejected_by_name(change, setting):
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker

    change = dict(change)
    v2 = change.pop("kv_cache_manager_v2", None)
    args = make_llm_args(dict(BASE_SPEC, **change))
    if v2 is not None:
        args.kv_cache_config.use_kv_cache_manager_v2 = v2
    for cls in (DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker):
        with pytest.raises(ValueError, match=setting.replace("[", r"\[")):
            cls(args)


def test_several_attention_windows_are_refused_saying_what_is_missing():
    """Variable sliding-window attention: TensorRT-LLM's V1 manager (the one
    kvbm moves blocks of) refuses a connector with several window sizes, and
    per-window pools reach a connector only through KVCacheManagerV2's
    layout and per-layer-group calls, which kvbm does not implement. The
    refusal says so, and the connector indeed implements none of them."""
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker

    args = make_llm_args(dict(BASE_SPEC))
    args.kv_cache_config.max_attention_window = [512, 4096, 512, 4096]
    for cls in (DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker):
        with pytest.raises(ValueError) as e:
            cls(args)
        msg = str(e.value)
        assert "kv_cache_config.max_attention_window=[512, 4096, 512, 4096]" in msg
        assert "KV Cache Connector is not supported with multiple window sizes" in msg
        for api in ("register_kv_cache_layout", "update_state_after_alloc_by_layer_group",
                    "request_finished_by_layer_group", "KVCacheManagerV2"):
            assert api in msg
    # register_kv_cache_layout only turns kvbm off (test_kv_cache_manager_v2_layout_turns_kvbm_off_on_both_sides);
    # the per-layer-group scheduler calls are not kvbm's (TensorRT-LLM's defaults refuse several groups).
    for name in ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group"):
        meth = getattr(DynamoKVBMConnectorLeader, name, None)
        assert meth is None or meth.__qualname__.split(".")[0] != "DynamoKVBMConnectorLeader"
    # One window size (repeated per layer) is served.
    args.kv_cache_config.max_attention_window = [4096, 4096]
    from kvbm.trtllm_integration.connector._common import check_supported

    check_supported(args)


def test_attention_dp_is_rejected():
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorWorker

    args = make_llm_args(dict(BASE_SPEC))
    args.enable_attention_dp = True
    with pytest.raises(ValueError, match="enable_attention_dp"):
        DynamoKVBMConnectorWorker(args)


def test_policy_enum_is_accepted_by_name():
    import enum

    from kvbm.trtllm_integration.connector._common import check_supported

    class CapacitySchedulerPolicy(enum.Enum):
        GUARANTEED_NO_EVICT = 1

    args = make_llm_args(dict(BASE_SPEC))
    args.scheduler_config.capacity_scheduler_policy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    check_supported(args)


@pytest.mark.parametrize("api", APIS)
def test_offloaded_prefix_onboards_byte_exact_on_each_rank(make_engine, api):
    eng = make_engine(api=api)
    assert [i["host_blocks"] for i in eng.infos] == [128, 128]
    assert eng.leader.info()["host_blocks"] == 128
    first = toks(5 * BS + 3)
    a = FakeLlmRequest(1, first, 4)
    eng.submit(a)
    eng.run()
    # 46 tokens have KV (the last sampled token is never computed): 5 full blocks.
    saves = saves_of(eng.plans)
    assert len(saves) == 5
    assert len({s[2] for s in saves}) == 5
    eng.plans.clear()
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, 5), loaded.append(r.request_id))
    b = eng.submit(FakeLlmRequest(2, a.tokens[:46] + toks(7, 900), 3))
    eng.run()
    assert b.matched == 5 * BS and loaded == [2]
    # The loaded blocks are not offloaded again; the new ones are.
    assert len(saves_of(eng.plans)) == (len(b.tokens) - 1) // BS - 5


@pytest.mark.parametrize("api", APIS)
def test_chunked_prefill_overlap_scheduler_and_resent_block_lists(make_engine, api):
    eng = make_engine(chunk=2 * BS, overlap=True, resend_blocks=True, api=api)
    a = FakeLlmRequest(1, toks(6 * BS + 5), 12)
    eng.submit(a)
    eng.run()
    saves = saves_of(eng.plans)
    # 64 tokens have KV; with the overlap scheduler the connector never learns
    # the 64th token before the request ends, so 7 full blocks are offloaded,
    # each exactly once although every step resent the whole block list.
    assert len(saves) == 7
    assert len({s[0] for s in saves}) == 7 and len({s[2] for s in saves}) == 7
    run_b = FakeLlmRequest(2, a.tokens[:64] + toks(5, 700), 2)
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, 7), loaded.append(r.request_id))
    eng.submit(run_b)
    eng.run()
    assert run_b.matched == 7 * BS and loaded == [2]


def test_request_finished_while_its_last_block_is_saved(make_engine):
    eng = make_engine()
    # Prefill computes 15 tokens (block 0 full); the one decode step computes
    # token 15, filling block 1, and the request ends in that step. Its blocks
    # are scribbled over as soon as request_finished returns.
    a = FakeLlmRequest(1, toks(2 * BS - 1), 2)
    assert eng.submit(a)
    eng.run()
    assert not eng.new_saving and all(not p["saving"] for p in eng.pending)
    assert len(saves_of(eng.plans)) == 2
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, 2), loaded.append(r.request_id))
    b = eng.submit(FakeLlmRequest(2, a.tokens[:2 * BS] + [5, 6, 7], 1))
    eng.run()
    assert b.matched == 2 * BS and loaded == [2]


@pytest.mark.parametrize("api", APIS)
def test_preempted_request_is_replayed_with_its_prefix_loaded(make_engine, api):
    eng = make_engine(api=api)
    a = FakeLlmRequest(1, toks(3 * BS + 2), 20)
    eng.submit(a)
    while a.generated < 7:
        eng.step()
    assert len(saves_of(eng.plans)) == 4  # 32 of 33 tokens computed
    eng.preempt(a)
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, 4), loaded.append(r.request_id))
    eng.run()
    assert loaded == [1] and a.matched == 4 * BS and a.phase == "done"
    # After the replay the request saved block 4 from its new G1 blocks.
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, 5), loaded.append(r.request_id))
    c = eng.submit(FakeLlmRequest(3, a.tokens[:45] + [1, 2], 1))
    eng.run()
    assert c.matched == 5 * BS and loaded == [1, 3]


def test_device_prefix_hit_then_kvbm_loads_the_rest(make_engine):
    eng = make_engine()
    first = toks(4 * BS + 1)
    run_and_onboard(eng, first, 1, first[:4 * BS] + [9, 9, 9], expect_blocks=4, device_hit_blocks=1)


def test_leader_calls_are_recorded(make_engine, tmp_path):
    """DYN_KVBM_ENABLE_RECORD: each call TensorRT-LLM makes on the leader is
    one JSON line with its inputs and outputs; the engine's result is the
    same as without it."""
    import json

    path = tmp_path / "records.jsonl"
    eng = make_engine(env_extra={"DYN_KVBM_ENABLE_RECORD": "1", "DYN_KVBM_RECORD_PATH": str(path)})
    first = toks(4 * BS + 1)
    run_and_onboard(eng, first, 1, first[:4 * BS] + [9, 9, 9], expect_blocks=4)
    from kvbm import _record

    assert _record.flush()  # records are written by a background thread
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["engine"] for r in recs} == {"trtllm"}
    matched = [r for r in recs if r["method"] == "get_num_new_matched_tokens"]
    assert [(m["inputs"]["request"]["request_id"], m["inputs"]["request"]["num_tokens"]) for m in matched] == [
        (1, len(first)), (2, 4 * BS + 3)]
    assert [m["output"] for m in matched] == [[0, False], [4 * BS, True]]
    alloc = [r for r in recs if r["method"] == "update_state_after_alloc"]
    assert {a["inputs"]["request"]["request_id"] for a in alloc} == {1, 2}
    assert all(isinstance(b, int) for a in alloc for b in a["inputs"]["block_ids"])
    metas = [r for r in recs if r["method"] == "build_connector_meta"]
    assert metas and all(m["output"]["bytes"] > 0 for m in metas)
    finished = [r for r in recs if r["method"] == "request_finished"]
    assert sorted(f["inputs"]["request"]["request_id"] for f in finished) == [1, 2]


def test_disk_tier_onboarding(make_engine, tmp_path):
    eng = make_engine(env_extra={
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4",
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "64",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
        "DYN_KVBM_DISK_DISABLE_O_DIRECT": "true",
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
    }, chunk=2 * BS)
    first = toks(8 * BS + 1)
    run_and_onboard(eng, first, 1, first[:8 * BS] + [3, 3], expect_blocks=8)


def test_rank0_worker_in_the_leader_process_reports_bytes_per_block(make_engine, tmp_path):
    # TensorRT-LLM's rank 0 holds both objects: the leader learns the exact
    # bytes per block from the worker (here the tiers are sized in GB and the
    # model has no config.json, so nothing else could tell it).
    spec_one = {"tp": 1, "model_dir": str(tmp_path / "nomodel")}
    pool = InProcessPool()
    try:
        eng = make_engine(env_extra={"DYN_KVBM_CPU_CACHE_GB": "0.0008",
                                     "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": None},
                          spec_extra=spec_one, workers=pool)
        os.remove(os.path.join(spec_one["model_dir"], "config.json"))
        bpb = eng.infos[0]["bytes_per_block"]
        assert bpb == 4 * 2 * BS * 4 * 16 * 2
        first = toks(3 * BS + 1)
        run_and_onboard(eng, first, 1, first[:3 * BS] + [1], expect_blocks=3)
        assert eng.leader.info()["host_blocks"] == int(0.0008e9 // bpb)
    finally:
        pool.close()


@pytest.mark.parametrize("api", APIS)
def test_leader_without_bytes_per_block_disables_itself(make_engine, tmp_path, caplog, api):
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader

    make_engine()  # sets the environment
    os.environ.pop("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")
    os.environ["DYN_KVBM_CPU_CACHE_GB"] = "1"
    leader = DynamoKVBMConnectorLeader(make_llm_args(dict(BASE_SPEC, model_dir=str(tmp_path / "none"))))
    try:
        if api == "main":
            assert leader.wait_for_initialization() is None  # never raises into the engine
            assert leader._disabled_reason is not None
        r = FakeLlmRequest(7, toks(20), 1)
        assert leader.get_num_new_matched_tokens(r, 0) == (0, False)
        assert leader.build_connector_meta(SchedulerOutput()) == b""
        assert leader.request_finished(r, []) is False
        assert "block size in bytes is unknown" in caplog.text
    finally:
        leader.shutdown()


def test_invalid_environment_fails_start_up_naming_the_variable(monkeypatch):
    import kvbm
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader

    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "lots")
    with pytest.raises(kvbm.KvbmError, match="DYN_KVBM_CPU_CACHE_GB"):
        DynamoKVBMConnectorLeader(make_llm_args(dict(BASE_SPEC)))


# ------------------------------------------------------- worker, in-process


@pytest.fixture
def rank0(make_engine, tmp_path):
    pool = InProcessPool()
    eng = make_engine(spec_extra={"tp": 1}, workers=pool)
    yield eng, pool.side
    pool.close()


def test_get_finished_returns_saving_ids_at_once_and_loads_once_announced(rank0):
    eng, side = rank0
    w = side.w
    assert w.get_finished([11, 12], []) == ([11, 12], [])
    # A load finished by the worker is held until TensorRT-LLM announces it,
    # then returned exactly once.
    w._done.add(5)
    assert w.get_finished([], []) == ([], [])
    assert w.get_finished([], [5]) == ([], [5])
    assert w.get_finished([], []) == ([], [])


def test_announced_load_without_a_plan_is_released_after_grace(rank0, caplog):
    _, side = rank0
    w = side.w
    assert w.get_finished([], [42]) == ([], [])
    assert w.get_finished([], []) == ([], [42])
    assert "no plan carried its load" in caplog.text


def test_worker_failure_releases_inflight_loads_without_raising(rank0):
    _, side = rank0
    w = side.w
    w._inflight[9] = [3, 4]

    class Broken:
        def finished(self):
            raise RuntimeError("boom")

        def close(self):
            pass

    real, w._worker = w._worker, Broken()
    try:
        assert w.get_finished([], [9]) == ([], [9])
        assert w._failed and "boom" in w._failed
        # Everything after a failure is a no-op, never an exception.
        w.bind_connector_meta(b"\x81\xa1q\x01")
        w.start_load_kv(None)
        w.wait_for_save(None)
        assert w.get_finished([1], []) == ([1], [])
    finally:
        w._worker = real


def test_leader_resent_whole_block_list_is_deduplicated(rank0):
    eng, _ = rank0
    leader = eng.leader
    r = FakeLlmRequest(1, toks(2 * BS), 1)
    new = RequestData(1, r.tokens, [10, 11], 0, BS)
    plan1 = leader.build_connector_meta(SchedulerOutput(new_requests=[new]))
    again = RequestData(1, [], [10, 11], BS, BS)  # whole list resent, second chunk
    plan2 = leader.build_connector_meta(SchedulerOutput(cached_requests=[again]))
    from kvbm._adapter_common import plan_summary

    assert [s[0] for s in plan_summary(plan1)["saves"]] == [10]
    assert [s[0] for s in plan_summary(plan2)["saves"]] == [11]
    assert leader.request_finished(r, [10, 11]) is False


# ------------------------------------- leader's consolidator: G1 + G2 on NATS

from kvbm.testing.ports import free_ports  # noqa: E402
from test_trtllm_publisher import NatsSub, nats_server  # noqa: E402,F401 - fixture reuse


def _engine_stored(eid, parent, blocks):
    return {"event_id": eid, "window_size": 1 << 20, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35, "mm_keys": [],
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks_]}
        for h, toks_ in blocks]}}


def _engine_removed(eid, hashes):
    return {"event_id": eid, "window_size": 1 << 20, "data": {"type": "removed", "block_hashes": hashes}}


def test_leader_consolidator_merges_engine_and_kvbm_events_on_nats(make_engine, nats_server):
    import kvbm
    from kvbm.trtllm_integration.publisher import ZmqKvEventPublisher

    # The consolidator publishes on pub_port + 1000 (Dynamo's rule).
    zport, pub_port = free_ports(2)
    while pub_port + 1000 > 65535 or zport == pub_port + 1000:
        zport, pub_port = free_ports(2)
    sub = NatsSub(nats_server, "namespace.ns.component.tensorrt_llm.kv-events")
    engine_pub = ZmqKvEventPublisher(BS, endpoint=f"tcp://127.0.0.1:{zport}")
    pool = InProcessPool()
    try:
        eng = make_engine(env_extra={
            "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true", "DYN_KVBM_TRTLLM_ZMQ_PORT": str(zport),
            "DYN_KVBM_LEADER_ZMQ_PUB_PORT": str(pub_port), "DYN_KVBM_WORKER_ID": "3", "DYN_NAMESPACE": "ns",
            # wait_for_initialization starts the leader and its consolidator.
            "NATS_SERVER": f"nats://127.0.0.1:{nats_server}",
        }, spec_extra={"tp": 1}, workers=pool)
        assert eng.leader.info()["host_blocks"] == 128
        got = []

        def read_until(pred):
            while True:
                m = sub.next_message()
                got.append(m)
                if pred(m):
                    return

        def is_store_of(h):
            return lambda m: "stored" in m["event"]["data"] and any(
                b["block_hash"] == h for b in m["event"]["data"]["stored"]["blocks"])

        # Wait until the consolidator reads the engine stream: a probe block.
        probe_tokens = list(range(5000, 5000 + BS))
        deadline = time.monotonic() + 20
        while True:
            engine_pub.publish(_engine_stored(None, None, [(777, probe_tokens)]))
            try:
                sub.sock.settimeout(0.2)
                read_until(is_store_of(777))
                break
            except OSError:
                assert time.monotonic() < deadline, "the leader's consolidator never read the engine events"
        sub.sock.settimeout(10)
        engine_pub.publish(_engine_removed(None, [777]))

        # kvbm offloads request 1's three full blocks to G2 (STOREs from kvbm)...
        a = eng.submit(FakeLlmRequest(1, toks(3 * BS + 1), 1))
        eng.run()
        # ... and the engine reports the same blocks (plus the partial tail)
        # under its own hashes: deduplicated, no second STORE.
        ext = [(1 << 64) - 11, (1 << 63) + 3, 99, 100]
        blocks = [(ext[i], a.tokens[i * BS:(i + 1) * BS]) for i in range(3)] + [(ext[3], a.tokens[3 * BS:])]
        engine_pub.publish(_engine_stored(1, None, blocks))
        # The engine evicts them: kvbm's G2 still holds them, so no REMOVE.
        engine_pub.publish(_engine_removed(2, ext))
        # Sentinel: a block stored and removed by the engine only.
        engine_pub.publish(_engine_stored(3, None, [(888, list(range(6000, 6000 + BS)))]))
        engine_pub.publish(_engine_removed(4, [888]))
        read_until(lambda m: m["event"]["data"] == {"removed": {"block_hashes": [888]}})
    finally:
        engine_pub.close()
        sub.close()
        pool.close()

    local = {kvbm.router_hashes(a.tokens[i * BS:(i + 1) * BS], BS)[0] for i in range(3)}
    stores = [(m["storage_tier"], b) for m in got if "stored" in m["event"]["data"]
              for b in m["event"]["data"]["stored"]["blocks"]]
    ours = [s for s in stores if s[1]["tokens_hash"] in local]
    assert len(ours) == 3, f"one STORE per logical block, got {ours}"
    # kvbm registered them first (its sequence hashes); the engine's later
    # STOREs of the same tokens only added a holder.
    assert {b["block_hash"] for _, b in ours} == set(kvbm.sequence_hashes(a.tokens[:3 * BS], BS))
    removed = [h for m in got if "removed" in m["event"]["data"] for h in m["event"]["data"]["removed"]["block_hashes"]]
    assert removed == [777, 888]
    assert all(m["worker_id"] == 3 for m in got)
    idx = RouterIndex()
    idx.apply_all([m for m in got if m["event"]["event_id"] >= got[0]["event"]["event_id"]])
    idx.assert_consistent()
    assert len(idx.blocks(3)) == 3


@pytest.mark.parametrize("priorities, saved", [
    (None, 3),  # no retention config: TensorRT-LLM's default priority (35) passes
    ([60, 60, 60], 3),
    ([80, 80, 10], 2),  # per block: the two 80s, not the step's minimum
    ([60, 30, 60], 1),  # a prefix: offload stops at the first block below
    ([20], 0),
])
def test_retention_priorities_drive_the_offload_filter(make_engine, priorities, saved):
    from kvbm._adapter_common import plan_summary

    pool = InProcessPool()
    try:
        eng = make_engine(env_extra={"DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY": "35"}, spec_extra={"tp": 1},
                          workers=pool)
        rd = RequestData(1, toks(3 * BS), [4, 5, 6], 0, 3 * BS, priorities=priorities)
        plan = eng.leader.build_connector_meta(SchedulerOutput(new_requests=[rd]))
        assert [s[0] for s in plan_summary(plan)["saves"]] == [4, 5, 6][:saved]
    finally:
        pool.close()


def test_decode_blocks_are_filtered_by_their_own_priority(make_engine):
    from kvbm._adapter_common import plan_summary

    pool = InProcessPool()
    try:
        eng = make_engine(env_extra={"DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY": "35"}, spec_extra={"tp": 1},
                          workers=pool)
        step = eng.leader.build_connector_meta
        plan = step(SchedulerOutput(new_requests=[RequestData(1, toks(2 * BS), [4, 5], 0, 2 * BS,
                                                              priorities=[90, 90])]))
        assert [s[0] for s in plan_summary(plan)["saves"]] == [4, 5]
        # Decode fills block 6 (decode_retention_priority 10): not offloaded.
        for i in range(BS):
            rd = RequestData(1, [7 + i], [6] if i == 0 else [], 2 * BS + i, 1, priorities=[10] if i == 0 else [])
            plan = step(SchedulerOutput(cached_requests=[rd]))
            assert plan_summary(plan)["saves"] == []
    finally:
        pool.close()


U64 = (1 << 64) - 1


@pytest.mark.parametrize("salt_a, salt_b, shared", [
    (None, None, True),
    (7, 7, True),
    (7, 8, False),
    (None, 7, False),
    (U64, U64, True),  # >= 2^63: survives the C ABI intact
    ((1 << 63) + 5, (1 << 63) + 6, False),
    ((1 << 63) + 5, 5, False),  # the high bit is not dropped
])
@pytest.mark.parametrize("api", APIS)
def test_cache_salt_id_keeps_tenants_apart(make_engine, salt_a, salt_b, shared, api):
    """TensorRT-LLM's LlmRequest.cache_salt_id: the same tokens under another
    salt match nothing in G2; under the same salt they load byte-exact (1.2's
    RequestData carries no salt: the LlmRequest's, read at matching, keys
    the request's saves)."""
    eng = make_engine(api=api)
    prompt = toks(4 * BS + 3)
    a = FakeLlmRequest(1, prompt, 2)
    a.cache_salt_id = salt_a
    eng.submit(a)
    eng.run()
    assert a.phase == "done"
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, r.matched // BS), loaded.append(r))
    b = FakeLlmRequest(2, prompt, 2)
    b.cache_salt_id = salt_b
    eng.submit(b)
    eng.run()
    assert b.phase == "done"
    assert b.matched == (4 * BS if shared else 0)
    assert loaded == ([b] if shared else [])


def test_request_data_salt_keys_an_unmatched_request(make_engine):
    """A request the connector never matched is offloaded under the salt of
    its RequestData (cache_salt_id, or the cache_salt string of releases that
    report the string)."""
    pool = InProcessPool()
    try:
        eng = make_engine(spec_extra={"tp": 1}, workers=pool)
        salt = (1 << 63) + 1
        eng.leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, toks(3 * BS), [4, 5, 6], 0, 3 * BS, cache_salt_id=salt),
            RequestData(2, toks(3 * BS, start=900), [7, 8, 9], 0, 3 * BS, cache_salt="tenant-a"),
        ]))
        for rid, (tokens, salt_id, want) in enumerate([
            (toks(3 * BS), salt, 3 * BS),
            (toks(3 * BS), salt - (1 << 63), 0),
            (toks(3 * BS), None, 0),
            (toks(3 * BS, start=900), None, 0),
        ], start=10):
            r = FakeLlmRequest(rid, tokens + [1], 1)
            r.cache_salt_id = salt_id
            assert eng.leader.get_num_new_matched_tokens(r, 0) == ((want, True) if want else (0, False))
            eng.leader.request_finished(r, [])
    finally:
        pool.close()


def test_cache_salt_id_is_mixed_as_its_decimal_string():
    from types import SimpleNamespace

    from kvbm import _native
    from kvbm.trtllm_integration.connector.kvbm_connector_leader import _cache_salt

    assert _cache_salt(SimpleNamespace(cache_salt_id=U64)) == "18446744073709551615"
    # A binding that reports the u64 as a signed 64-bit value names the same salt.
    assert _cache_salt(SimpleNamespace(cache_salt_id=-1)) == "18446744073709551615"
    assert _cache_salt(SimpleNamespace(cache_salt_id=0)) == "0"
    assert _cache_salt(SimpleNamespace(cache_salt_id=None, cache_salt="tenant-a")) == "tenant-a"
    assert _cache_salt(SimpleNamespace(cache_salt_id=None)) is None
    assert _native.salt_hash(_cache_salt(SimpleNamespace(cache_salt_id=U64))) != _native.salt_hash(
        _cache_salt(SimpleNamespace(cache_salt_id=U64 >> 1)))


@pytest.mark.parametrize("api", APIS)
def test_leader_starts_at_wait_for_initialization_or_on_first_use(make_engine, api):
    """Newer TensorRT-LLM calls wait_for_initialization once every rank
    registered its KV cache: the Go leader (its tiers, its consolidator)
    starts there, not in the first request's matching; 1.2 never calls it
    and the leader starts on first use."""
    eng = make_engine(api=api)
    assert (eng.leader._leader is not None) == (api == "main")
    first = toks(3 * BS + 1)
    run_and_onboard(eng, first, 1, first[:3 * BS] + [4, 4], expect_blocks=3)


@pytest.mark.parametrize("api", APIS)
def test_retention_priorities_from_the_engine_filter_offload_per_block(make_engine, api):
    """A request's KvCacheRetentionConfig reaches the connector as one
    priority per new block (newer RequestData.priorities): blocks [80, 80,
    10] under a threshold of 35 offload the two 80s, and a later request
    loads exactly those. 1.2 reports no priorities: every block has
    TensorRT-LLM's default (35) and is offloaded."""
    eng = make_engine(api=api, env_extra={"DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY": "35"})
    a = FakeLlmRequest(1, toks(3 * BS + 1), 1)
    a.retention = [80, 80, 10]
    eng.submit(a)
    eng.run()
    kept = 2 if api == "main" else 3
    assert len(saves_of(eng.plans)) == kept
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, kept), loaded.append(r.request_id))
    b = eng.submit(FakeLlmRequest(2, a.tokens[:3 * BS] + [9, 9], 1))
    eng.run()
    assert b.matched == kept * BS and loaded == [2]


@pytest.mark.parametrize("api", APIS)
def test_split_context_lists_order_new_requests_by_chunk_state(make_engine, api):
    """Newer ScheduledRequests keeps context requests still chunking apart
    from those on their last chunk, and the connector manager lists the
    chunking ones first: a request admitted later can come first in
    SchedulerOutput. Both requests' blocks are saved under their own
    prefixes and load byte-exact."""
    eng = make_engine(api=api, chunk=2 * BS)
    short = eng.submit(FakeLlmRequest(1, toks(BS + 1, start=300), 1))
    long = eng.submit(FakeLlmRequest(2, toks(6 * BS + 1, start=600), 1))
    eng.step()
    first = [rd.request_id for rd in eng.outputs[0].new_requests]
    assert first == ([2, 1] if api == "main" else [1, 2])
    eng.run()
    assert short.phase == long.phase == "done"
    loaded = []
    eng.on_loaded = lambda r: (eng.check_prefix(r, 0, r.matched // BS), loaded.append(r.request_id))
    c = eng.submit(FakeLlmRequest(3, long.tokens[:6 * BS] + [1, 2], 1))
    d = eng.submit(FakeLlmRequest(4, short.tokens[:BS] + [1, 2], 1))
    eng.run()
    assert (c.matched, d.matched) == (6 * BS, BS) and sorted(loaded) == [3, 4]


def test_kv_cache_manager_v2_layout_turns_kvbm_off_on_both_sides(make_engine, caplog):
    """Newer TensorRT-LLM with KVCacheManagerV2 (e.g. use_kv_cache_manager_v2=
    auto resolving to it) registers a layout instead of the primary pool:
    the worker turns kvbm off, the leader in its process follows at
    wait_for_initialization, and requests are served without kvbm."""
    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorLeader, DynamoKVBMConnectorWorker
    from kvbm.trtllm_integration.connector._common import LOCAL

    make_engine()  # sets the environment
    LOCAL.reset()
    args = make_llm_args(dict(BASE_SPEC, tp=1))
    args.kv_cache_config.use_kv_cache_manager_v2 = "auto"
    worker = DynamoKVBMConnectorWorker(args)
    leader = DynamoKVBMConnectorLeader(args)
    try:
        assert "use_kv_cache_manager_v2=auto" in caplog.text
        assert worker.register_kv_cache_layout(object()) is None
        assert worker._worker is None and "KVCacheManagerV2" in worker._disabled_reason
        leader.wait_for_initialization()
        assert leader._leader is None and "KVCacheManagerV2" in leader._disabled_reason
        r = FakeLlmRequest(1, toks(3 * BS + 1), 1)
        assert leader.get_num_new_matched_tokens(r, 0) == (0, False)
        assert leader.build_connector_meta(SchedulerOutput()) == b""
    finally:
        leader.shutdown()
        worker.shutdown()


def test_cancelled_load_drops_it_and_turns_kvbm_off(make_engine):
    """KVCacheManagerV2 may withdraw part of a promised load; kvbm plans loads
    whole, so it drops the load (no plan carries it to the workers) and
    stops promising loads."""
    eng = make_engine()
    a = eng.submit(FakeLlmRequest(1, toks(4 * BS + 1), 1))
    eng.run()
    assert a.phase == "done"
    leader = eng.leader
    b = FakeLlmRequest(2, a.tokens[:4 * BS] + [7], 1)
    assert leader.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    leader.update_state_after_alloc(b, list(range(40, 45)))
    assert leader.cancel_load(b, 2 * BS, 4 * BS) is None
    assert leader._failed is not None and "cancelled tokens" in leader._failed
    plan = leader.build_connector_meta(SchedulerOutput())
    assert plan == b""
    c = FakeLlmRequest(3, a.tokens[:4 * BS] + [8], 1)
    assert leader.get_num_new_matched_tokens(c, 0) == (0, False)


def test_g4_onboarding_rank0_in_the_leader_process(make_engine, s3_server, tmp_path):
    # G4 with TensorRT-LLM's layout of processes at TP=1: the leader shares
    # rank 0's store (and registry), so it matches what the worker uploaded
    # without a lookup. After the G2 copies are gone, the prefix is loaded
    # from the object store, byte-exact.
    import time

    pool = InProcessPool()
    try:
        eng = make_engine(env_extra=s3_server.env("kvbm-trtllm"), spec_extra={"tp": 1}, workers=pool)
        g4 = eng.leader.info()["g4"]  # this process's counters so far
        first = toks(6 * BS + 1)
        a = eng.submit(FakeLlmRequest(1, first, 1))
        eng.run()
        assert a.phase == "done"
        end = time.time() + 30
        while eng.leader.info()["g4"]["offload_blocks_h2obj"] - g4["offload_blocks_h2obj"] < 6:
            assert time.time() < end, eng.leader.info()["g4"]
            time.sleep(0.01)
        assert eng.leader.reset_cache()
        loaded = []
        eng.on_loaded = lambda r: (eng.check_prefix(r, 0, r.matched // BS), loaded.append(r))
        b = eng.submit(FakeLlmRequest(2, first[:6 * BS] + [5, 5], 2))
        eng.run()
        assert b.matched == 6 * BS
        assert loaded == [b] and b.phase == "done"
        assert eng.leader.info()["g4"]["onboard_blocks_obj2h"] - g4["onboard_blocks_obj2h"] == 6
    finally:
        pool.close()


def test_g4_onboarding_tp2_rank1_in_its_own_process(make_engine, s3_server, tmp_path):
    # TP=2 as TensorRT-LLM runs it: the leader and rank 0's worker in this
    # process, rank 1 in another. Each rank uploads its own shard under its
    # own fingerprint; after the G2 copies are gone, both ranks load the
    # prefix from the object store, each byte-exact.
    import time

    from kvbm.testing.s3server import count_objects

    from trtllm_contract import MixedPool

    bucket = "kvbm-trtllm-tp2"
    pool = MixedPool(2)
    try:
        eng = make_engine(env_extra=s3_server.env(bucket), spec_extra={"tp": 2}, workers=pool)
        g4 = eng.leader.info()["g4"]
        first = toks(6 * BS + 1)
        a = eng.submit(FakeLlmRequest(1, first, 1))
        eng.run()
        assert a.phase == "done"
        # Both ranks' objects are in the bucket, and rank 0's uploads have
        # returned (counted here after its store's registry, which the leader
        # matches against, learnt them): an object is on the server's disk
        # before the server answers its PUT.
        end = time.time() + 60
        while (count_objects(s3_server.state_dir, bucket) < 2 * 6  # 6 blocks × 2 ranks
               or eng.leader.info()["g4"]["offload_blocks_h2obj"] - g4["offload_blocks_h2obj"] < 6):
            assert time.time() < end, (count_objects(s3_server.state_dir, bucket), eng.leader.info()["g4"])
            time.sleep(0.02)
        assert eng.leader.reset_cache()
        loaded = []
        eng.on_loaded = lambda r: (eng.check_prefix(r, 0, r.matched // BS), loaded.append(r))
        b = eng.submit(FakeLlmRequest(2, first[:6 * BS] + [5, 5], 2))
        eng.run()
        assert b.matched == 6 * BS
        assert loaded == [b] and b.phase == "done", (b.phase, eng.leader.info())
        assert eng.leader.info()["g4"]["onboard_blocks_obj2h"] - g4["onboard_blocks_obj2h"] == 6
    finally:
        pool.close()
