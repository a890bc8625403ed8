"""kvbm's vLLM connector (``DynamoConnector``) driven through vLLM's scheduler
and worker calls by small stand-ins for vLLM's objects (reference/vllm.md
§1.5): the scheduler-side and worker-side connectors in one process, as with
TP=1, CPU tensors standing in for the KV cache."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from kvbm._adapter_common import plan_summary
from kvbm.testing.vllm_fakes import vllm_config

BS = 4
LAYERS = 2
NUM_BLOCKS = 32
HEADS, HEAD_DIM = 2, 8


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
    return monkeypatch


def kv_cache_config():
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = 2 * BS * HEADS * HEAD_DIM * 2  # K and V, float16
    spec = SimpleNamespace(page_size_bytes=page)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                                    layer_names=names)])


class Blocks:
    """vLLM's KVCacheBlocks: one KV cache group."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def request(rid: str, tokens, priority: int = 0):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), cache_salt=None, lora_request=None,
                           priority=priority, mm_features=None, prompt_embeds=None)


def scheduler_output(new=(), finished=()):
    """new: (request, block ids, num_computed) scheduled for the rest of its prompt."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.all_token_ids,
                                            block_ids=(list(blocks),), num_computed_tokens=computed)
                            for r, blocks, computed in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: len(r.all_token_ids) - computed for r, _, computed in new},
        finished_req_ids=set(finished),
    )


class Engine:
    """The scheduler-side and worker-side connectors of one vLLM instance."""

    def __init__(self):
        from kvbm.vllm_integration.connector import DynamoConnector

        cfg, kvc = vllm_config(BS), kv_cache_config()
        self.sched = DynamoConnector(cfg, SimpleNamespace(name="SCHEDULER"), kvc)
        self.worker = DynamoConnector(cfg, SimpleNamespace(name="WORKER"), kvc)
        g = torch.Generator().manual_seed(0)
        self.kv = {f"model.layers.{i}.self_attn.attn":
                   torch.randint(-1000, 1000, (2, NUM_BLOCKS, HEADS, BS, HEAD_DIM), generator=g).to(torch.float16)
                   for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        assert self.worker._worker is not None

    def step(self, so, forward=True):
        """One engine step: build_connector_meta, then the worker's calls.
        Returns (metadata, finished_recving, invalid block ids)."""
        meta = self.sched.build_connector_meta(so)
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if forward:
            w.wait_for_save()
        _, recving = w.get_finished(set(so.finished_req_ids))
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.sched.update_connector_output(SimpleNamespace(finished_recving=recving, invalid_block_ids=invalid))
        return meta, recving or set(), invalid

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


@pytest.fixture
def engine(env):
    eng = Engine()
    yield eng
    eng.close()


@pytest.mark.parametrize("priority", [0, 7, -3])
def test_request_priority_never_filters_offload(env, priority):
    """vLLM's request priority orders scheduling, not retention: with
    DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY set, every full block is still
    offloaded (it used to pass -priority, so 0 < threshold offloaded nothing)."""
    env.setenv("DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY", "50")
    eng = Engine()
    try:
        r = request("r1", range(100, 100 + 3 * BS + 1), priority=priority)
        assert eng.sched.get_num_new_matched_tokens(r, 0) == (0, False)
        eng.sched.update_state_after_alloc(r, Blocks([]), 0)
        meta, _, _ = eng.step(scheduler_output(new=[(r, [3, 4, 5, 6], 0)]))
        assert [s[0] for s in plan_summary(meta.plan)["saves"]] == [3, 4, 5]
    finally:
        eng.close()


def offload_prompt(eng, tokens, blocks):
    a = request("a", tokens)
    assert eng.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    eng.sched.update_state_after_alloc(a, Blocks([]), 0)
    eng.step(scheduler_output(new=[(a, blocks, 0)]))
    assert eng.sched.request_finished(a, blocks) == (False, None)
    eng.step(scheduler_output(finished=["a"]), forward=False)


def promise_load(eng, tokens, blocks, device_hit=0):
    """Matching and allocation of a request whose prefix kvbm holds: vLLM now
    waits for the asynchronous load (WAITING_FOR_REMOTE_KVS)."""
    b = request("b", tokens)
    got, is_async = eng.sched.get_num_new_matched_tokens(b, device_hit)
    assert got > 0 and is_async
    eng.sched.update_state_after_alloc(b, Blocks(blocks), got)
    return b, got


def test_promised_load_completes(engine):
    tokens = list(range(200, 200 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    _, got = promise_load(engine, tokens, [10, 11, 12, 13, 14])
    assert got == 4 * BS
    meta, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert plan_summary(meta.plan)["loads"] == {"b": [10, 11, 12, 13]}
    deadline = time.monotonic() + 60  # loads are asynchronous: wait by wall clock, not by step count
    while not recving and time.monotonic() < deadline:
        _, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert recving == {"b"} and invalid == set()
    for i in range(4):
        for layer in engine.kv.values():
            assert torch.equal(layer[:, 10 + i], layer[:, 1 + i])


def test_prompt_cached_whole_loads_every_block(engine):
    """A prompt that ends on a block boundary and is cached whole: kvbm loads
    all of its blocks and answers one token short of the prompt, so vLLM
    computes only the last token (over loaded KV) instead of a whole block."""
    tokens = list(range(250, 250 + 4 * BS))
    offload_prompt(engine, tokens, [1, 2, 3, 4])
    _, got = promise_load(engine, tokens, [10, 11, 12, 13])
    assert got == 4 * BS - 1
    meta, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert plan_summary(meta.plan)["loads"] == {"b": [10, 11, 12, 13]}
    deadline = time.monotonic() + 60  # loads are asynchronous: wait by wall clock, not by step count
    while not recving and time.monotonic() < deadline:
        _, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert recving == {"b"} and invalid == set()
    for i in range(4):
        for layer in engine.kv.values():
            assert torch.equal(layer[:, 10 + i], layer[:, 1 + i])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cache_hit_sources_name_the_tier_of_each_loaded_block(env, tier):
    """vLLM asks, right after update_state_after_alloc, which tier the hit
    tokens come from (its per-source prefix cache metrics): G2 is host, G3
    disk, block by block; tokens kvbm did not plan count as unspecified."""
    source = pytest.importorskip("vllm.v1.metrics.cache_hit_source").CacheHitSource
    if tier == "disk":  # disk only: blocks go G1 → G3 directly
        env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "0")
        env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    want = source.HOST if tier == "host" else source.DISK
    eng = Engine()
    try:
        tokens = list(range(300, 300 + 4 * BS + 2))
        offload_prompt(eng, tokens, [1, 2, 3, 4, 5])
        b, got = promise_load(eng, tokens, [10, 11, 12, 13, 14])
        assert got == 4 * BS
        assert eng.sched.get_external_cache_hit_sources(b, got) == {want: got}
        assert eng.sched.get_external_cache_hit_sources(b, got - 1) == {want: got - 1}
        other = request("x", tokens)
        assert eng.sched.get_external_cache_hit_sources(other, 5) == {source.EXTERNAL_UNSPECIFIED: 5}
        assert eng.sched.get_external_cache_hit_sources(b, 0) == {}
        assert eng.worker.get_external_cache_hit_sources(b, got) == {}  # scheduler only
    finally:
        eng.close()


def _raise(*_args, **_kwargs):
    raise RuntimeError("injected leader failure")


# Where kvbm fails between vLLM's promise (get_num_new_matched_tokens answered
# an asynchronous load, update_state_after_alloc accepted it) and the plan
# that would carry the load to the workers.
FAILURE_POINTS = [
    "between_match_and_alloc",  # another request's call, before this one's allocation
    "update_after_alloc",  # the leader, while planning this load
    "after_alloc",  # another request's call, after this one's allocation
    "build_connector_meta",  # the leader, while planning the step
]


@pytest.mark.parametrize("where", FAILURE_POINTS)
def test_leader_failure_before_the_load_is_planned_reports_it_failed_within_one_step(engine, where):
    tokens = list(range(300, 300 + 3 * BS + 1))
    offload_prompt(engine, tokens, [1, 2, 3, 4])
    sched, leader = engine.sched, engine.sched._leader
    b = request("b", tokens)
    got, is_async = sched.get_num_new_matched_tokens(b, 0)
    assert (got, is_async) == (3 * BS, True)
    if where == "between_match_and_alloc":
        leader.request_finished = _raise
        sched.request_finished(request("x", [1]), [])
    if where == "update_after_alloc":
        leader.update_after_alloc = _raise
    sched.update_state_after_alloc(b, Blocks([20, 21, 22, 23]), got)
    if where == "after_alloc":
        leader.request_finished = _raise
        sched.request_finished(request("x", [1]), [])
    if where == "build_connector_meta":
        leader.step = _raise
    # The very next step reports the load finished with every block failed,
    # so vLLM's scheduler takes the request back and recomputes them.
    meta, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert sched._failed is not None
    assert meta.failed_loads == {"b": [20, 21, 22]}
    assert recving == {"b"}
    assert invalid == {20, 21, 22}
    # Reported once.
    _, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert recving == set() and invalid == set()


def test_request_aborted_while_its_load_is_promised_is_still_reported(engine):
    """vLLM keeps an aborted WAITING_FOR_REMOTE_KVS request's blocks until its
    load is reported finished: the report must come even after a failure."""
    tokens = list(range(500, 500 + 2 * BS + 1))
    offload_prompt(engine, tokens, [1, 2, 3])
    b, _ = promise_load(engine, tokens, [20, 21, 22])
    engine.sched.request_finished(b, [20, 21, 22])
    engine.sched._leader.step = _raise
    _, recving, invalid = engine.step(scheduler_output(finished=["b"]), forward=False)
    assert recving == {"b"} and invalid == {20, 21}


def test_failure_after_the_load_is_planned_leaves_it_to_the_worker(engine):
    tokens = list(range(400, 400 + 2 * BS + 1))
    offload_prompt(engine, tokens, [1, 2, 3])
    promise_load(engine, tokens, [20, 21, 22])
    meta, recving, _ = engine.step(scheduler_output(), forward=False)
    assert plan_summary(meta.plan)["loads"] == {"b": [20, 21]}
    engine.sched._leader.step = _raise
    deadline = time.monotonic() + 60  # loads are asynchronous: wait by wall clock, not by step count
    while not recving and time.monotonic() < deadline:
        meta, recving, invalid = engine.step(scheduler_output(), forward=False)
        assert meta.failed_loads == {}, "a planned load is not reported twice"
    assert recving == {"b"}


def test_repeated_matching_of_a_waiting_request_is_cached_and_freed(engine):
    """vLLM asks again on every step a request waits: the same answer each
    time, its tokens converted once, the conversion dropped when the request
    finishes (also one that never got scheduled)."""
    tokens = list(range(300, 300 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    leader = engine.sched._leader
    w = request("w", tokens)
    answers = {engine.sched.get_num_new_matched_tokens(w, 0) for _ in range(3)}
    assert answers == {(4 * BS, True)}
    assert "w" in leader._token_cache
    other = request("o", [t + 1 for t in tokens])
    assert engine.sched.get_num_new_matched_tokens(other, 0) == (0, False)
    engine.sched.request_finished(other, [])
    assert engine.sched.request_finished(w, []) == (False, None)
    assert leader._token_cache == {}
    engine.step(scheduler_output(finished=["w", "o"]), forward=False)


# ------------------------------------------------------------------------------
# Through FakeVllm: vLLM's scheduler and worker calls in their order, with
# chunked prefill, preemption, aborts, and KV contents checked on every load.

from kvbm.testing import vllm_fakes as vf  # noqa: E402


def fake_vllm(num_blocks=NUM_BLOCKS, token_budget=64, groups=1, **kw):
    from kvbm.vllm_integration.connector import DynamoConnector

    kvc = vf.kv_cache_config(num_blocks, BS, LAYERS, HEADS, HEAD_DIM, groups=groups)
    names = [n for g in kvc.kv_cache_groups for n in g.layer_names]
    kv = {n: torch.zeros((2, num_blocks, HEADS, BS, HEAD_DIM), dtype=torch.float16) for n in names}
    return vf.FakeVllm(DynamoConnector, vllm_config(BS), kvc, kv, token_budget=token_budget, **kw)


@pytest.fixture
def vllm(env):
    made = []

    def make(**kw):
        made.append(fake_vllm(**kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def prompt(seed, n):
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def test_fake_engine_serves_a_repeated_prompt_from_kvbm(vllm):
    eng = vllm()
    p = prompt(1, 5 * BS + 1)
    eng.add(vf.FakeRequest("a", p))
    eng.run()
    b = eng.add(vf.FakeRequest("b", p))
    eng.run()
    assert b.external_hits == [5 * BS]
    assert eng.wrong_kv == []
    assert eng.recving_reports == ["b"]


def test_chunked_prefill_offloads_each_block_once_as_it_fills(vllm):
    """A prompt prefilled over several steps (token budget): each step saves
    only blocks its forward pass completed, every block exactly once, and
    the prompt is later served whole from kvbm."""
    eng = vllm(token_budget=2 * BS + 1)
    p = prompt(2, 6 * BS + 2)
    a = eng.add(vf.FakeRequest("a", p, max_tokens=1))
    computed_after, saved = [], []
    while a.status != vf.FINISHED:
        meta = eng.step()
        saved.append([s[0] for s in plan_summary(meta.plan)["saves"]])
        computed_after.append(a.num_computed_tokens if a.status != vf.FINISHED else len(p))
    assert len(saved) >= 3, "the prompt was not chunked"
    blocks = list(range(NUM_BLOCKS))[:7]  # the fake allocates G1 blocks in order
    for step_saves, computed in zip(saved, computed_after):
        assert all(blocks.index(b) < computed // BS for b in step_saves), (saved, computed_after)
    assert sorted(b for s in saved for b in s) == blocks[:6]
    eng.run()
    b = eng.add(vf.FakeRequest("b", p))
    eng.run()
    assert b.external_hits == [6 * BS] and eng.wrong_kv == []


def test_preempted_request_resumes_from_kvbm(vllm):
    """G1 runs out while two requests decode: vLLM preempts the newer one
    and frees its blocks; on resumption it is matched again, gets back from
    kvbm what it had computed, and what it computes after resuming is saved
    under its new G1 blocks."""
    eng = vllm(num_blocks=8)
    a = eng.add(vf.FakeRequest("a", prompt(3, 4 * BS - 1), max_tokens=4))
    b = eng.add(vf.FakeRequest("b", prompt(4, 4 * BS - 1), max_tokens=3))
    eng.run()
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.external_hits[0] == 0 and b.external_hits[1] >= 3 * BS, b.external_hits
    assert any(b.request_id in so.scheduled_cached_reqs.resumed_req_ids for so in eng.outputs), "b was not resumed"
    assert eng.wrong_kv == []
    assert len(b.output) == 3
    # Everything b computed, before and after the preemption, is in kvbm
    # with the right contents.
    full = list(b.all_token_ids)
    c = eng.add(vf.FakeRequest("c", full, max_tokens=1))
    eng.run()
    assert c.external_hits == [(len(full) - 1) // BS * BS] and eng.wrong_kv == []


@pytest.mark.parametrize("when", ["load_planned", "load_reported"])
def test_request_aborted_while_loading_is_reported_once_and_frees_its_blocks(vllm, when):
    """vLLM keeps the G1 blocks of an aborted WAITING_FOR_REMOTE_KVS request
    until a worker reports its load, and asserts on a report for a request
    it no longer holds: the load is reported exactly once, the blocks come
    back, and kvbm's source blocks are released (the prompt still hits)."""
    eng = vllm()
    p = prompt(5, 5 * BS + 1)
    eng.add(vf.FakeRequest("a", p))
    eng.run()

    def abort_once_planned(fake, meta):
        if meta.plan and "b" in plan_summary(meta.plan)["loads"]:
            fake.abort("b")

    b = eng.add(vf.FakeRequest("b", p))
    if when == "load_planned":  # arrives while the step that carries the load runs
        eng.after_schedule = abort_once_planned
    else:  # arrives after the worker reported the load, before the request is scheduled
        deadline = time.monotonic() + 60
        while "b" not in eng.finished_recving and time.monotonic() < deadline:
            eng.step()
        eng.abort("b")
    eng.run()
    assert b.status == vf.FINISHED and b.output == []
    assert eng.recving_reports.count("b") == 1
    eng.after_schedule = None
    c = eng.add(vf.FakeRequest("c", p))
    eng.run()
    assert c.external_hits == [5 * BS] and eng.wrong_kv == []


def _raise(*_args, **_kwargs):
    raise RuntimeError("injected kvbm failure")


# Each engine call of both roles, by the kvbm object call it makes.
ENGINE_CALLS = [
    ("sched", "get_num_new_matched_tokens", "match"),
    ("sched", "update_state_after_alloc", "update_after_alloc"),
    ("sched", "build_connector_meta", "step"),
    ("sched", "request_finished", "request_finished"),
    ("worker", "bind_connector_metadata", "bind"),
    ("worker", "start_load_kv", "start_load"),
    ("worker", "wait_for_save", "wait_for_save"),
    ("worker", "get_finished", "finished"),
]


@pytest.mark.parametrize("when", ["before_admission", "while_loading"])
@pytest.mark.parametrize("side,call,target", ENGINE_CALLS, ids=[c[1] for c in ENGINE_CALLS])
def test_failure_at_each_engine_call_keeps_vllm_serving(vllm, side, call, target, when):
    """kvbm fails inside one engine call (before a hit is admitted, or while
    its load is with the worker): the call returns normally, kvbm is off for
    that side, every request finishes, every G1 block comes back, and no
    load is reported twice or with wrong contents."""
    eng = vllm(token_budget=2 * BS + 1)
    p, q = prompt(6, 5 * BS + 1), prompt(7, 4 * BS + 3)
    eng.add(vf.FakeRequest("a", p))
    eng.run()
    conn = eng.sched if side == "sched" else eng.worker
    obj = conn._leader if side == "sched" else conn._worker

    def inject():
        setattr(obj, target, _raise)

    def inject_once_b_loads(fake, meta):
        if meta.plan and "b" in plan_summary(meta.plan)["loads"]:
            inject()
            fake.after_schedule = None

    if when == "before_admission":
        inject()
    else:
        eng.after_schedule = inject_once_b_loads
    reqs = [eng.add(vf.FakeRequest(r, toks, max_tokens=3)) for r, toks in (("b", p), ("c", q), ("d", p))]
    eng.run()
    assert conn._failed is not None and conn._failed.lstrip("_").startswith(call), conn._failed
    assert all(r.status == vf.FINISHED and len(r.output) == 3 for r in reqs)
    assert len(eng.free) == NUM_BLOCKS
    assert eng.wrong_kv == []
    # Every load vLLM waited for was reported, once (a failed load sends the
    # request back through matching: a second admission, a second load).
    for r in reqs:
        assert eng.recving_reports.count(r.request_id) == r.loads_promised, (r.request_id, eng.recving_reports)
    if when == "while_loading":
        assert reqs[0].loads_promised >= 1
    # Nothing kvbm does after the failure reaches the engine.
    assert conn.get_block_ids_with_load_errors() == set()


def test_worker_that_cannot_start_keeps_vllm_serving(env, monkeypatch):
    """register_kv_caches fails (the worker cannot be created): the
    scheduler still promises loads, and the worker answers each one as
    failed, so vLLM recomputes instead of waiting."""
    import kvbm._core

    class Broken:
        def __init__(self, *a, **k):
            raise RuntimeError("injected: no pinned memory")

    monkeypatch.setattr(kvbm._core, "Worker", Broken)
    eng = fake_vllm()
    try:
        assert eng.worker._failed is not None and eng.worker._failed.startswith("register_kv_caches")
        p = prompt(8, 3 * BS + 1)
        eng.add(vf.FakeRequest("a", p))
        eng.run()
        b = eng.add(vf.FakeRequest("b", p))
        eng.run()
        assert b.status == vf.FINISHED and len(eng.free) == NUM_BLOCKS and eng.wrong_kv == []
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["mm_features", "prompt_embeds"])
def test_multimodal_and_embedding_prompts_bypass_kvbm_both_ways(vllm, kind):
    """Token ids do not identify the KV of a multimodal prompt (image
    placeholders) or of prompt embeddings: such a request gets no hit from a
    text prompt with the same ids, and what it computes is never offloaded
    (a text prompt with the same ids must not receive it)."""
    eng = vllm()
    p = prompt(9, 4 * BS + 1)
    special = {kind: [SimpleNamespace(identifier="img0")] if kind == "mm_features" else torch.zeros(1)}
    m = eng.add(vf.FakeRequest("m", p, **special))
    eng.run()
    assert m.external_hits == [0]
    assert all(not meta.plan or not plan_summary(meta.plan)["saves"] for meta in eng.metas), "multimodal KV offloaded"
    t = eng.add(vf.FakeRequest("t", p))
    eng.run()
    assert t.external_hits == [0]
    m2 = eng.add(vf.FakeRequest("m2", p, **special))
    eng.run()
    assert m2.external_hits == [0] and eng.wrong_kv == []
    assert eng.sched._failed is None and eng.worker._failed is None


def test_groups_kvbm_cannot_serve_disable_kvbm_on_both_sides_and_vllm_serves(vllm, caplog):
    """Several KV cache groups of a kind kvbm does not serve (here the
    fake's untyped specs; Mamba in tests/test_vllm_hybrid.py): kvbm turns
    itself off with a log line naming the kinds, on the scheduler and on
    the worker (no host memory taken), and the engine serves without it."""
    eng = vllm(groups=2)
    for side in (eng.sched, eng.worker):
        assert side._disabled_reason and "are not served by kvbm yet" in side._disabled_reason
    assert eng.sched._leader is None and eng.worker._worker is None
    p = prompt(10, 3 * BS + 1)
    a = eng.add(vf.FakeRequest("a", p))
    eng.run()
    b = eng.add(vf.FakeRequest("b", p))
    eng.run()
    assert a.external_hits == b.external_hits == [0]
    assert all(not meta.plan for meta in eng.metas)
    assert "kvbm disabled for this engine" in caplog.text


def events_config(endpoint="tcp://*:5557", enabled=True):
    return SimpleNamespace(enable_kv_cache_events=enabled, endpoint=endpoint, publisher="zmq")


@pytest.mark.parametrize("endpoint, env, message", [
    ("ipc:///tmp/kv-events", {}, "kv_events_config.endpoint='ipc:///tmp/kv-events': expected tcp://host:port"),
    ("tcp://*:70000", {}, "kv_events_config.endpoint port=70000"),
    ("tcp://*:5557", {"DYN_KVBM_LEADER_ZMQ_PUB_PORT": "65000"}, "consolidator output port"),
    ("tcp://*:5557", {"DYN_KVBM_KV_EVENTS_BIND_HOST": "tcp://0.0.0.0"}, "DYN_KVBM_KV_EVENTS_BIND_HOST"),
])
def test_consolidator_configuration_errors_fail_start_up_by_name(env, endpoint, monkeypatch, message):
    """An endpoint the consolidator cannot use is a configuration error: the
    scheduler-side connector fails vLLM's start-up naming the setting,
    instead of serving without the consolidated event stream."""
    from kvbm.vllm_integration.connector import DynamoConnector

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "true")
    cfg = vllm_config(BS)
    cfg.kv_events_config = events_config(endpoint)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        DynamoConnector(cfg, SimpleNamespace(name="SCHEDULER"), kv_cache_config())


def test_consolidator_runs_only_for_kvbm_with_prefix_caching_and_events(env):
    from kvbm.vllm_integration.consolidator_config import should_enable_consolidator

    env.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "true")
    cfg = vllm_config(BS)
    cfg.kv_events_config = events_config()
    assert should_enable_consolidator(cfg)
    env.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    assert not should_enable_consolidator(cfg)
    env.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "true")
    cfg.kv_events_config = events_config(enabled=False)
    assert not should_enable_consolidator(cfg), "vLLM publishes no events"
    cfg.kv_events_config = events_config()
    cfg.cache_config.enable_prefix_caching = False
    assert not should_enable_consolidator(cfg), "no prefix caching: no block events to merge"
    cfg.cache_config.enable_prefix_caching = True
    cfg.kv_transfer_config = SimpleNamespace(kv_connector="LMCacheConnectorV1", kv_connector_module_path=None,
                                             kv_connector_extra_config={})
    assert not should_enable_consolidator(cfg), "another connector"
    cfg.kv_transfer_config = SimpleNamespace(
        kv_connector="PdConnector", kv_connector_module_path=None,
        kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector"},
                                                  {"kv_connector": "DynamoConnector"}]})
    assert should_enable_consolidator(cfg), "kvbm inside Dynamo's PdConnector"


# ------------------------------------------------------------------------------
# get_mem_pool_context: vLLM allocates the KV cache inside what the worker-side
# connector returns (KVBM_CUDA_PACK_KV_CACHE, kvbm/_kvpool.py).

def test_mem_pool_context_off_by_default_and_worker_only(env):
    from kvbm.vllm_integration.connector import DynamoConnector

    kvc = vf.kv_cache_config(NUM_BLOCKS, BS, LAYERS, HEADS, HEAD_DIM)
    worker = DynamoConnector(vllm_config(BS), SimpleNamespace(name="WORKER"), kvc)
    sched = DynamoConnector(vllm_config(BS), SimpleNamespace(name="SCHEDULER"), kvc)
    try:
        assert worker.get_mem_pool_context() is None  # vLLM then uses its own allocation
        env.setenv("KVBM_CUDA_PACK_KV_CACHE", "1")
        assert sched.get_mem_pool_context() is None
        ctx = worker.get_mem_pool_context()
        assert ctx is not None
        with ctx:  # without CUDA: allocations as usual
            t = torch.zeros((2, NUM_BLOCKS, HEADS, BS, HEAD_DIM), dtype=torch.float16)
        assert t.shape[1] == NUM_BLOCKS
        env.setenv("KVBM_CUDA_PACK_KV_CACHE", "sometimes")
        with pytest.raises(ValueError, match="KVBM_CUDA_PACK_KV_CACHE"):
            worker.get_mem_pool_context()
    finally:
        worker.shutdown()
        sched.shutdown()
