"""kvbm's vLLM connector with vLLM's hybrid KV cache manager on: several KV
cache groups (full attention beside sliding-window attention, as Gemma 3),
built with vLLM's own KVCacheConfig and spec classes, laid out as vLLM lays
them out (layer i of every group shares one tensor, each group using its
own blocks of it), driven through the scheduler and worker calls vLLM makes."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

from kvbm import _plan  # noqa: E402
from kvbm.testing.vllm_fakes import vllm_config  # noqa: E402

BS = 4
HEADS, HEAD_DIM = 2, 8
NUM_BLOCKS = 40
WINDOW = 2 * BS
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SLIDING = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
GROUP_OF = {**{n: 0 for n in FULL}, **{n: 1 for n in SLIDING}}
NULL = 0  # vLLM's null block


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
    return monkeypatch


def attn(cls, **kw):
    return cls(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16, **kw)


def hybrid_config(second=None):
    """Full attention (layers 0, 2) and sliding window (layers 1, 3), as
    vLLM's uniform-page-size grouping makes them: tensor i shared by layer
    i of each group."""
    second = second or attn(SlidingWindowSpec, sliding_window=WINDOW)
    full = attn(FullAttentionSpec)
    page = full.page_size_bytes
    tensors = [KVCacheTensor(size=page * NUM_BLOCKS, layers=[FULL[i], SLIDING[i]], layer_stride=0, block_stride=page)
               for i in range(2)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, second)])


class Blocks:
    """vLLM's KVCacheBlocks: one block id list per group."""

    def __init__(self, *per_group):
        self.per_group = tuple(list(g) for g in per_group)

    def get_block_ids(self, allow_none=False):
        return self.per_group


def request(rid, tokens):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), cache_salt=None, lora_request=None,
                           priority=0, mm_features=None, prompt_embeds=None)


def value(p, layer, kv):
    return float((p * 13 + layer * 5 + kv * 3) % 1999 - 999)


class Hybrid:
    """vLLM's scheduler-side and worker-side connectors over a two-group KV cache."""

    def __init__(self, kvc=None):
        from kvbm.vllm_integration.connector import DynamoConnector

        kvc = kvc or hybrid_config()
        cfg = vllm_config(BS)
        self.sched = DynamoConnector(cfg, SimpleNamespace(name="SCHEDULER"), kvc)
        self.worker = DynamoConnector(cfg, SimpleNamespace(name="WORKER"), kvc)
        shared = [torch.full((2, NUM_BLOCKS, HEADS, BS, HEAD_DIM), 1234.0, dtype=torch.float16) for _ in range(2)]
        # Layer names map to views of the shared tensors, as vLLM's runner hands them over.
        self.kv = {FULL[i]: shared[i].view(shared[i].shape) for i in range(2)}
        self.kv.update({SLIDING[i]: shared[i].view(shared[i].shape) for i in range(2)})
        self.worker.register_kv_caches(self.kv)

    def layer_index(self, name):
        return int(name.split(".")[2])

    def forward(self, per_group, start, end):
        """Write the KV of positions [start, end) into each group's blocks
        (a sliding-window group writes every position it holds a block for)."""
        for name, t in self.kv.items():
            ids = per_group[GROUP_OF[name]]
            for p in range(start, end):
                b = ids[p // BS]
                if b == NULL:
                    continue
                for kv in (0, 1):
                    t[kv, b, :, p % BS, :] = value(p, self.layer_index(name), kv)

    def holds(self, name, b, p):
        t = self.kv[name]
        return all(bool((t[kv, b, :, p % BS, :] == value(p, self.layer_index(name), kv)).all()) for kv in (0, 1))

    def step(self, new=(), finished=(), cached=()):
        """new, cached: (request, per-group block ids (all, or those added
        this step for cached), num_computed, num_scheduled)."""
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.all_token_ids,
                                                block_ids=tuple(list(g) for g in ids), num_computed_tokens=c)
                                for r, ids, c, _ in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r, _, _, _ in cached], resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached],
                new_block_ids=[tuple(list(g) for g in ids) for _, ids, _, _ in cached],
                num_computed_tokens=[c for _, _, c, _ in cached]),
            num_scheduled_tokens={r.request_id: n for r, _, _, n in list(new) + list(cached)},
            finished_req_ids=set(finished),
        )
        meta = self.sched.build_connector_meta(so)
        return meta, so

    def run_worker(self, meta, so, forward=None, mutate_plan=None):
        w = self.worker
        if mutate_plan is not None:
            meta.plan = mutate_plan(meta.plan)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if forward is not None:
            forward()
        w.wait_for_save()
        self.worker._worker.wait_loads()
        res = w.get_transfer_results(set(so.finished_req_ids))
        invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        self.sched.update_connector_output(SimpleNamespace(finished_recving=res.finished_recving,
                                                           invalid_block_ids=invalid,
                                                           kv_connector_worker_meta=worker_meta))
        return res, invalid

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


@pytest.fixture
def hybrid(env):
    h = Hybrid()
    yield h
    h.close()


def test_kvbm_declares_hma_so_vllm_keeps_its_hybrid_manager():
    from kvbm.vllm_integration.connector import DynamoConnector

    assert supports_hma(DynamoConnector)


PROMPT = list(range(100, 100 + 5 * BS + 1))
A0, A1 = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]  # request a's blocks, full and sliding group


def store_a(h):
    """Request a computes its prompt; kvbm saves its 5 full blocks."""
    a = request("a", PROMPT)
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    h.sched.update_state_after_alloc(a, Blocks(A0, A1), 0)
    meta, so = h.step(new=[(a, (A0, A1), 0, len(PROMPT))])
    rows = _plan.group_rows(meta.plan)
    # Every block it saves has a row naming both groups' blocks there.
    assert {c[1] for c in _plan.decode(meta.plan)["saves"]} == set(A0[:5])
    assert rows == {A0[i]: [A0[i], A1[i]] for i in range(5)}
    res, invalid = h.run_worker(meta, so, forward=lambda: h.forward((A0, A1), 0, len(PROMPT)))
    assert not invalid and not res.failed_recving
    assert h.sched.request_finished_all_groups(a, (A0, A1)) == (False, None)
    h.step(finished=["a"])
    for t in {id(t): t for t in h.kv.values()}.values():  # vLLM reuses a's blocks
        t[:, A0 + A1].fill_(-7.0)


def test_two_groups_load_into_each_groups_blocks_and_skip_the_null_block(hybrid):
    """A prefix stored from two groups loads every layer from one kvbm block
    per position: full-attention layers into the full group's blocks,
    sliding-window layers only into the blocks inside the window (vLLM
    gives the sliding group the null block before it, which stays
    untouched)."""
    h = hybrid
    store_a(h)
    b = request("b", PROMPT)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
    # vLLM allocates for 5 * BS external tokens: the sliding group skips the
    # blocks before the window ending at 5 * BS (3 blocks) with the null block.
    b0, b1 = [13, 14, 15, 16, 17, 18], [NULL, NULL, NULL, 19, 20, 21]
    h.sched.update_state_after_alloc(b, Blocks(b0, b1), 5 * BS)
    meta, so = h.step()
    loads = _plan.decode(meta.plan)["loads"]
    assert sorted(c[3] for c in loads["b"]) == b0[:5]
    rows = _plan.group_rows(meta.plan)
    assert rows == {b0[i]: [b0[i], -1 if b1[i] == NULL else b1[i]] for i in range(5)}
    null_before = {n: h.kv[n][:, NULL].clone() for n in h.kv}
    res, invalid = h.run_worker(meta, so)
    assert res.finished_recving == {"b"} and not res.failed_recving and not invalid
    for p in range(5 * BS):
        for name in FULL:
            assert h.holds(name, b0[p // BS], p), (name, p)
        if b1[p // BS] != NULL:
            for name in SLIDING:
                assert h.holds(name, b1[p // BS], p), (name, p)
    for n in h.kv:
        assert torch.equal(h.kv[n][:, NULL], null_before[n]), f"{n}: the null block was written"
    # Block 21 (position 5, not loaded) is untouched.
    assert bool((h.kv[SLIDING[0]][:, 21] == 1234.0).all())


def test_a_prompt_cached_whole_leaves_vllm_its_last_block_with_a_sliding_window(hybrid):
    """A prompt of whole blocks cached whole: with a sliding-window group
    the hit stays block aligned (the last block is left to vLLM), as vLLM's
    own prefix cache caps it. Loading all but the last token would make vLLM
    allocate the window ending one token short of the boundary, which starts
    a block later than the window its own later G1 hits of that prompt need
    (block 23 of a 1024-token prompt with a 256-token window), so that prompt
    would never hit G1 again."""
    h = hybrid
    tokens = PROMPT[:5 * BS]
    a = request("a", tokens)
    h.sched.update_state_after_alloc(a, Blocks(A0[:5], A1[:5]), 0)
    meta, so = h.step(new=[(a, (A0[:5], A1[:5]), 0, len(tokens))])
    h.run_worker(meta, so, forward=lambda: h.forward((A0, A1), 0, len(tokens)))
    h.sched.request_finished_all_groups(a, (A0[:5], A1[:5]))
    h.step(finished=["a"])
    assert h.sched.get_num_new_matched_tokens(request("b", tokens), 0) == (4 * BS, True)


def test_one_full_attention_group_still_loads_a_prompt_cached_whole(env):
    """Without a windowed group every block loads and vLLM computes only the last token."""
    from kvbm.vllm_integration.connector._groups import kv_groups

    full = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(FULL, attn(FullAttentionSpec))])
    layout, _ = kv_groups(full, BS)
    assert layout is not None and layout.full_hit_ok
    layout, _ = kv_groups(hybrid_config(), BS)
    assert layout is not None and not layout.full_hit_ok


def test_a_failed_block_fails_the_whole_requests_load(hybrid):
    """With several groups vLLM maps failures to requests, not blocks: a
    load with one failed block is reported in failed_recving (vLLM
    recomputes the request), and no block id is reported."""
    h = hybrid
    store_a(h)
    b = request("b", PROMPT)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
    b0, b1 = [13, 14, 15, 16, 17, 18], [NULL, NULL, NULL, 19, 20, 21]
    h.sched.update_state_after_alloc(b, Blocks(b0, b1), 5 * BS)
    meta, so = h.step()

    def drop_one_row(plan):
        rows = _plan.group_rows(plan)
        del rows[b0[4]]  # that block's copy fails in the worker
        return _plan.with_group_rows(plan, 2, rows)

    res, invalid = h.run_worker(meta, so, mutate_plan=drop_one_row)
    assert res.failed_recving == {"b"} and "b" in res.finished_recving
    assert invalid == set()
    # The leader learnt the failed block through the worker metadata and
    # dropped its source: the prefix now matches up to it.
    h.sched.request_finished_all_groups(b, (b0, b1))
    h.step(finished=["b"])
    assert h.sched.get_num_new_matched_tokens(request("c", PROMPT), 0) == (4 * BS, True)


def test_a_load_kvbm_never_planned_fails_the_request(hybrid, monkeypatch):
    """kvbm fails between the promise and the plan: the next metadata names
    the load, and the worker reports the request failed, not its blocks."""
    h = hybrid
    store_a(h)
    b = request("b", PROMPT)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
    b0, b1 = [13, 14, 15, 16, 17, 18], [NULL, NULL, NULL, 19, 20, 21]
    h.sched.update_state_after_alloc(b, Blocks(b0, b1), 5 * BS)
    monkeypatch.setattr(h.sched._scheduler_side._leader, "step",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    meta, so = h.step()
    assert meta.failed_loads == {"b": b0[:5]}
    res, invalid = h.run_worker(meta, so)
    assert res.failed_recving == {"b"} and "b" in res.finished_recving and invalid == set()


def test_mamba_groups_without_prefix_caching_turn_kvbm_off_naming_them_and_leave_hma_on(env, caplog):
    """A hybrid SSM model without vLLM's prefix caching of its state: kvbm
    turns itself off for the engine with one line naming the group kinds; it
    still declares HMA, so vLLM starts and serves the model."""
    from kvbm.vllm_integration.connector import DynamoConnector

    mamba = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=(torch.float16,), page_size_padded=256)
    h = Hybrid(hybrid_config(second=mamba))
    try:
        for side in (h.sched, h.worker):
            assert side._disabled_reason is not None
            assert "mamba" in side._disabled_reason and "full_attention" in side._disabled_reason
        assert h.sched._leader is None and h.worker._worker is None
        assert h.sched.get_num_new_matched_tokens(request("x", PROMPT), 0) == (0, False)
        assert supports_hma(DynamoConnector)
        assert "KV cache groups of kind mamba are not served by kvbm here" in caplog.text
    finally:
        h.close()


def test_mamba_without_prefix_caching_says_no_prefix_can_be_stored(env):
    mamba = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=(torch.float16,), page_size_padded=256,
                      mamba_cache_mode="none")
    h = Hybrid(hybrid_config(second=mamba))
    try:
        reason = h.sched._disabled_reason
        assert reason is not None and "mamba_cache_mode=none (prefix caching off)" in reason
        assert "no prefix of such a model can be stored or loaded" in reason
    finally:
        h.close()


def test_a_pure_state_space_model_is_refused_not_served_as_positions(env):
    """One KV cache group of recurrent state (a Mamba-only model): its
    blocks are states, not token positions, so kvbm must not store or load
    them as positions (it would load a state into the wrong boundary)."""
    from kvbm.vllm_integration.connector._groups import kv_groups

    mamba = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=(torch.float16,), mamba_cache_mode="align")
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(SLIDING, mamba)])
    layout, why = kv_groups(kvc, BS)
    assert layout is None and why is not None
    assert "only recurrent-state groups (mamba)" in why
    full = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(FULL, attn(FullAttentionSpec))])
    assert kv_groups(full, BS)[0] is not None  # one attention group: served as before


def test_group_layout_is_part_of_the_fingerprint(hybrid):
    from kvbm._core import Worker

    info = hybrid.worker._worker.info()
    assert "2 KV cache groups" in info["layout"]
    kv = hybrid.kv
    names = sorted(kv, key=lambda n: int(n.split(".")[2]))
    tensors = [(kv[n].data_ptr(), list(kv[n].shape), list(kv[n].stride())) for n in names]
    common = dict(tensors=tensors, kind="cpu", num_blocks=NUM_BLOCKS, block_size=BS, dtype_bytes=2,
                  model="", dtype="torch.float16")  # what the connector passes for this config
    groups = [GROUP_OF[n] for n in names]
    same = Worker(**common, layer_groups=groups, group_kinds=["full_attention", f"sliding_window({WINDOW})"])
    one = Worker(**common)
    # The same grouping with another window: deeper layers' KV differs.
    wider = Worker(**common, layer_groups=groups, group_kinds=["full_attention", f"sliding_window({2 * WINDOW})"])
    try:
        assert same.info()["fingerprint"] == info["fingerprint"]
        assert one.info()["fingerprint"] != info["fingerprint"]
        assert wider.info()["fingerprint"] != info["fingerprint"]
    finally:
        for w in (one, same, wider):
            w.close()


def test_which_group_layouts_kvbm_serves():
    """Full attention with sliding-window or chunked local groups is served
    (planned with the full group); a state group, no full-attention group,
    or another block size is refused with the reason."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from kvbm.vllm_integration.connector._groups import kv_groups

    chunked = attn(ChunkedLocalAttentionSpec, attention_chunk_size=4 * BS)
    groups, why = kv_groups(hybrid_config(second=chunked), BS)
    assert why is None and groups.kinds == ("full_attention", f"chunked_local({4 * BS})") and groups.primary == 0
    assert groups.layer_group == GROUP_OF

    cfg = hybrid_config()
    cfg.kv_cache_groups.reverse()  # the full group need not come first
    groups, why = kv_groups(cfg, BS)
    assert why is None and groups.primary == 1

    cfg = hybrid_config()
    cfg.kv_cache_groups[0] = KVCacheGroupSpec(FULL, attn(SlidingWindowSpec, sliding_window=3 * BS))
    groups, why = kv_groups(cfg, BS)
    assert groups is None and "none of full attention" in why

    big = FullAttentionSpec(block_size=2 * BS, num_kv_heads=HEADS // 2, head_size=HEAD_DIM, dtype=torch.float16)
    cfg = hybrid_config()
    cfg.kv_cache_groups[0] = KVCacheGroupSpec(FULL, big)
    groups, why = kv_groups(cfg, BS)
    assert groups is None and f"block size {2 * BS}" in why


def test_chunked_prefill_rows_follow_the_blocks_each_group_adds(hybrid):
    """A prompt computed in two chunks: the second step's saves name the
    blocks both groups added in that step (vLLM sends only the new ones)."""
    h = hybrid
    a = request("a", PROMPT)
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    first = ([1, 2], [7, 8])
    h.sched.update_state_after_alloc(a, Blocks(*first), 0)
    meta, so = h.step(new=[(a, first, 0, 2 * BS)])
    assert _plan.group_rows(meta.plan) == {1: [1, 7], 2: [2, 8]}
    h.run_worker(meta, so, forward=lambda: h.forward(first, 0, 2 * BS))
    added = ([3, 4, 5, 6], [9, 10, 11, 12])
    meta, so = h.step(cached=[(a, added, 2 * BS, len(PROMPT) - 2 * BS)])
    assert {c[1] for c in _plan.decode(meta.plan)["saves"]} == {3, 4, 5}
    assert _plan.group_rows(meta.plan) == {3: [3, 9], 4: [4, 10], 5: [5, 11]}
    res, invalid = h.run_worker(meta, so, forward=lambda: h.forward(([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]),
                                                                    2 * BS, len(PROMPT)))
    assert not invalid and not res.failed_recving


def test_request_finished_all_groups_is_recorded_as_request_finished(env, tmp_path):
    """vLLM calls request_finished_all_groups for every model once kvbm
    declares HMA: DYN_KVBM_ENABLE_RECORD still records request_finished,
    with the single group's block list as before."""
    import json

    env.setenv("DYN_KVBM_ENABLE_RECORD", "true")
    env.setenv("DYN_KVBM_RECORD_PATH", str(tmp_path / "records.jsonl"))
    from kvbm.testing import vllm_fakes as vf
    from kvbm.vllm_integration.connector import DynamoConnector

    kvc = vf.kv_cache_config(NUM_BLOCKS, BS, 2, HEADS, HEAD_DIM)
    sched = DynamoConnector(vllm_config(BS), SimpleNamespace(name="SCHEDULER"), kvc)
    try:
        assert sched.request_finished_all_groups(request("r", PROMPT), ([4, 5],)) == (False, None)
    finally:
        sched.shutdown()
    from kvbm import _record

    _record.flush()  # records are written by a background thread
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    finished = [r for r in recs if r.get("method") == "request_finished"]
    assert [f["inputs"]["request"]["request_id"] for f in finished] == ["r"], recs
    assert finished[0]["inputs"]["block_ids"] == [4, 5]


def test_one_sliding_window_group_never_touches_the_null_block(env):
    """A model whose every layer has a sliding window is one group under
    vLLM's hybrid manager, and vLLM gives it the null block before the
    window: kvbm's plan carries rows, so nothing is loaded into the null
    block, and a save from a block the window has left fails instead of
    reading a block vLLM may have handed to another request."""
    from kvbm.vllm_integration.connector import DynamoConnector

    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = attn(SlidingWindowSpec, sliding_window=WINDOW)
    page = spec.page_size_bytes
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                        kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, layers=[n], layer_stride=0,
                                                        block_stride=page) for n in names])
    cfg = vllm_config(BS)
    sched = DynamoConnector(cfg, SimpleNamespace(name="SCHEDULER"), kvc)
    worker = DynamoConnector(cfg, SimpleNamespace(name="WORKER"), kvc)
    kv = {n: torch.full((2, NUM_BLOCKS, HEADS, BS, HEAD_DIM), 1234.0, dtype=torch.float16) for n in names}
    worker.register_kv_caches(kv)

    def run(meta, so):
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker._worker.wait_loads()
        res = worker.get_transfer_results(set(so.finished_req_ids))
        worker.clear_connector_metadata()
        sched.update_connector_output(SimpleNamespace(finished_recving=res.finished_recving,
                                                      invalid_block_ids=worker.get_block_ids_with_load_errors()))
        return res

    def so(new=(), finished=()):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.all_token_ids,
                                                block_ids=(list(ids),), num_computed_tokens=0) for r, ids in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                                                  new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={r.request_id: len(r.all_token_ids) for r, _ in new},
            finished_req_ids=set(finished))

    try:
        a = request("a", PROMPT)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, Blocks(A0), 0)
        s = so(new=[(a, A0)])
        meta = sched.build_connector_meta(s)
        assert _plan.group_rows(meta.plan) == {b: [b] for b in A0[:5]}
        for n in names:
            kv[n][:, A0] = 3.0
        run(meta, s)
        sched.request_finished_all_groups(a, (A0,))
        s = so(finished=["a"])
        run(sched.build_connector_meta(s), s)

        b = request("b", PROMPT)
        assert sched.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
        ids = [NULL, NULL, NULL, 19, 20, 21]
        sched.update_state_after_alloc(b, Blocks(ids), 5 * BS)
        s = so()
        meta = sched.build_connector_meta(s)
        assert _plan.group_rows(meta.plan) == {NULL: [-1], 19: [19], 20: [20]}
        res = run(meta, s)
        assert res.finished_recving == {"b"}
        for n in names:
            assert bool((kv[n][:, NULL] == 1234.0).all()), "the null block was written"
            assert bool((kv[n][:, [19, 20]] == 3.0).all())
    finally:
        sched.shutdown()
        worker.shutdown()


# A save planned late for a position the window left gets no row: the Go
# leader builds the rows (goext/leader TestASaveFromAPositionTheWindowLeftGetsNoRow).


def test_several_groups_are_served_whatever_the_platform(monkeypatch):
    """The scheduler serves groups on a CUDA platform too (the CUDA copier
    copies per group: tests/test_gpu.py); it never asks where the KV lives."""
    from vllm.platforms import current_platform

    from kvbm.vllm_integration.connector._groups import kv_groups

    monkeypatch.setattr(current_platform, "device_type", "cuda", raising=False)
    groups, why = kv_groups(hybrid_config(), BS)
    assert why is None and groups is not None and groups.num_groups == 2


def test_one_full_attention_group_plans_exactly_as_before():
    """A model with one full-attention group (the common case, now with
    vLLM's hybrid manager on) gets no rows and no layer groups: its plans,
    fingerprint and copies are those of kvbm without groups."""
    from kvbm.vllm_integration.connector._groups import kv_groups

    full = attn(FullAttentionSpec)
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(FULL + SLIDING, full)])
    groups, why = kv_groups(kvc, BS)
    assert why is None and groups.num_groups == 1 and not groups.with_rows


def test_two_groups_survive_a_restart_through_the_persistent_disk_tier(env):
    """The persistent disk tier (DYN_KVBM_DISK_PERSIST) with two KV cache
    groups: a second connector pair on the same directory, on fresh
    tensors, recovers what the first stored and loads it into each group's
    blocks (sliding-window layers only inside the window, the null block
    untouched), the leader getting the recovered index through vLLM's
    handshake metadata as across processes. The same layers under another
    grouping, or the same grouping with another window, are other
    fingerprints: their tier files recover nothing and nothing matches."""
    env.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")  # disk only: saves go G1 → G3
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "32")
    env.setenv("DYN_KVBM_DISK_PERSIST", "true")
    h = Hybrid()
    try:
        assert h.worker._worker.info()["disk_persistent"] is True
        store_a(h)
    finally:
        h.close()

    h = Hybrid()
    try:
        assert h.worker._worker.info()["disk_recovered_blocks"] == 5
        h.sched.set_xfer_handshake_metadata({0: h.worker.get_handshake_metadata()})
        assert h.sched._scheduler_side._leader.info()["disk_blocks_used"] == 5
        b = request("b", PROMPT)
        assert h.sched.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
        b0, b1 = [13, 14, 15, 16, 17, 18], [NULL, NULL, NULL, 19, 20, 21]
        h.sched.update_state_after_alloc(b, Blocks(b0, b1), 5 * BS)
        meta, so = h.step()
        assert _plan.group_rows(meta.plan) == {b0[i]: [b0[i], -1 if b1[i] == NULL else b1[i]] for i in range(5)}
        res, invalid = h.run_worker(meta, so)
        assert res.finished_recving == {"b"} and not res.failed_recving and not invalid
        for p in range(5 * BS):
            for name in FULL:
                assert h.holds(name, b0[p // BS], p), (name, p)
            for name in SLIDING:
                if b1[p // BS] != NULL:
                    assert h.holds(name, b1[p // BS], p), (name, p)
                # A full-attention block never receives a sliding layer's KV, nor the reverse.
                assert not h.holds(name, b0[p // BS], p), (name, p)
        for n in h.kv:
            assert bool((h.kv[n][:, NULL] == 1234.0).all()), f"{n}: the null block was written"
        assert bool((h.kv[SLIDING[0]][:, 21] == 1234.0).all())
    finally:
        h.close()

    reordered = hybrid_config()
    reordered.kv_cache_groups.reverse()  # layer groups [1, 0, 1, 0]
    wider = hybrid_config(second=attn(SlidingWindowSpec, sliding_window=2 * WINDOW))
    for kvc in (reordered, wider):
        h = Hybrid(kvc)
        try:
            assert h.worker._worker.info()["disk_recovered_blocks"] == 0
            assert h.sched.get_num_new_matched_tokens(request("c", PROMPT), 0) == (0, False)
        finally:
            h.close()


def test_mamba_align_groups_are_served_beside_attention():
    """With vLLM's prefix caching of state (mamba_cache_mode='align') a
    state group beside full attention is served: its kind is named for the
    fingerprint, the leader gets which groups keep state, and a whole-prompt
    hit is not taken (the hit must end on a stored state before the last
    token). Speculative state blocks are refused with the reason."""
    from kvbm.vllm_integration.connector._groups import kv_groups

    page = attn(FullAttentionSpec).page_size_bytes
    mamba = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=(torch.float16,), page_size_padded=page,
                      mamba_cache_mode="align")
    layout, why = kv_groups(hybrid_config(second=mamba), BS)
    assert why is None, why
    assert layout.kinds == ("full_attention", "mamba") and layout.primary == 0
    assert layout.state == (False, True) and layout.has_state and layout.with_rows
    assert not layout.full_hit_ok
    spec = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=(torch.float16,), page_size_padded=page,
                     mamba_cache_mode="align", num_speculative_blocks=2)
    layout, why = kv_groups(hybrid_config(second=spec), BS)
    assert layout is None and "2 speculative blocks" in why


def test_state_views_cover_the_page_vllm_binds():
    """vLLM binds a state layer to a byte view [num_blocks, 1, 1, state
    bytes] of the tensor it shares with an attention layer, one page per
    block; state_views gives kvbm that layer as a view shaped like the
    attention layers over the same bytes, so block b is the page at b."""
    from kvbm.vllm_integration.connector._groups import GroupLayout, state_views

    nb, heads, head_dim = 6, 2, 8
    page = heads * BS * 2 * head_dim * 4  # float32 [heads, tokens, 2 x head_dim]
    raw = torch.zeros(2 * nb * page, dtype=torch.int8)
    attn_t = raw[:nb * page].view(torch.float32).view(nb, heads, BS, 2 * head_dim)
    state_t = torch.as_strided(raw[nb * page:], (nb, 1, 1, 64), (page, 64, 64, 1))
    layout = GroupLayout(("full_attention", "mamba"), 0, {"a": 0, "s": 1}, page, ((0, 0), (0, 0)), BS)
    views = state_views({"a": attn_t, "s": state_t}, layout)
    assert views["a"] is attn_t
    v = views["s"]
    assert v.shape == attn_t.shape and v.stride() == attn_t.stride() and v.dtype == attn_t.dtype
    state_t[3, 0, 0, :] = 7  # vLLM writes block 3's state
    page3 = v[3].contiguous().view(torch.int8).flatten()
    assert bool((page3[:64] == 7).all()) and bool((page3[64:] == 0).all())
    assert bool((raw[nb * page + 3 * page:nb * page + 3 * page + 64] == 7).all())
    # A state view whose blocks are not pages of the attention page size is refused.
    bad = torch.as_strided(raw[nb * page:], (nb, 1, 1, 64), (page // 2, 64, 64, 1))
    with pytest.raises(ValueError, match="block stride"):
        state_views({"a": attn_t, "s": bad}, layout)
