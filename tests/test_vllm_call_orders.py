"""Call orders of vLLM 0.33's scheduler and worker that 0.32 did not make,
driven through the fake vLLM of test_vllm_adapter.py (they run under either
release: the connector cannot tell which one calls it).

* With HiSparse and overlapping batches, 0.33 defers update_state_after_alloc
  of an asynchronous load until the steps in flight have finished: other
  steps (build_connector_meta) run between matching and allocation, and a
  request aborted meanwhile is finished without ever being allocated.
* Sleep mode: the GPU worker calls unregister_kv_caches before the KV cache
  memory is released and restore_kv_caches after wake-up.
* 0.33's model runner with a speculator takes a step's results
  (get_finished, load errors, stats, worker metadata) before its
  wait_for_save, which runs in finalize_step with clear_connector_metadata."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from kvbm._adapter_common import plan_summary
from test_vllm_adapter import BS, Blocks, engine, env, offload_prompt, request, scheduler_output  # noqa: F401


def wait_loaded(eng, rid):
    deadline = time.monotonic() + 60  # loads are asynchronous: wait by wall clock, not by step count
    recving, invalid = set(), set()
    while rid not in recving and time.monotonic() < deadline:
        _, recving, invalid = eng.step(scheduler_output(), forward=False)
    return recving, invalid


def test_allocation_deferred_past_other_steps_still_loads(engine):
    tokens = list(range(500, 500 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    b = request("b", tokens)
    got, is_async = engine.sched.get_num_new_matched_tokens(b, 0)
    assert got == 4 * BS and is_async
    # Steps in flight finish first (the load is deferred).
    for _ in range(2):
        meta, _, _ = engine.step(scheduler_output(), forward=False)
        assert plan_summary(meta.plan)["loads"] == {}
    engine.sched.update_state_after_alloc(b, Blocks([10, 11, 12, 13, 14]), got)
    meta, recving, invalid = engine.step(scheduler_output(), forward=False)
    assert plan_summary(meta.plan)["loads"] == {"b": [10, 11, 12, 13]}
    if "b" not in recving:
        recving, invalid = wait_loaded(engine, "b")
    assert recving == {"b"} and invalid == set()
    for i in range(4):
        for layer in engine.kv.values():
            assert torch.equal(layer[:, 10 + i], layer[:, 1 + i])


def test_request_aborted_before_its_deferred_allocation_is_forgotten(engine):
    tokens = list(range(600, 600 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    b = request("b", tokens)
    got, is_async = engine.sched.get_num_new_matched_tokens(b, 0)
    assert got > 0 and is_async
    engine.step(scheduler_output(), forward=False)
    # Aborted: finished without update_state_after_alloc (no load was started).
    assert engine.sched.request_finished(b, []) == (False, None)
    meta, recving, invalid = engine.step(scheduler_output(finished=["b"]), forward=False)
    assert plan_summary(meta.plan)["loads"] == {} and not recving and not invalid
    assert "b" not in engine.sched._scheduler_side._async_matches
    # The same id later is a new request: matched and loaded as usual.
    b2 = request("b", tokens)
    got, is_async = engine.sched.get_num_new_matched_tokens(b2, 0)
    assert got == 4 * BS and is_async
    engine.sched.update_state_after_alloc(b2, Blocks([20, 21, 22, 23, 24]), got)
    recving, invalid = wait_loaded(engine, "b")
    assert recving == {"b"} and invalid == set()
    for layer in engine.kv.values():
        assert torch.equal(layer[:, 20], layer[:, 1])


def test_sleep_stops_kvbm_before_the_memory_goes_and_it_stays_off(engine, caplog):
    """unregister_kv_caches (sleep) while a load is promised: the load is
    reported finished with its blocks failed (vLLM recomputes), kvbm never
    touches the KV cache tensors again (they stand for released memory),
    restore_kv_caches (wake-up) leaves kvbm off with a log line, and the
    engine's calls keep answering."""
    tokens = list(range(700, 700 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    b = request("b", tokens)
    got, _ = engine.sched.get_num_new_matched_tokens(b, 0)
    engine.sched.update_state_after_alloc(b, Blocks([10, 11, 12, 13, 14]), got)

    engine.worker.unregister_kv_caches()
    engine.worker.unregister_kv_caches()  # idempotent
    assert "sleep mode" in (engine.worker._failed or "")
    # The memory is released and mapped again, contents discarded.
    for layer in engine.kv.values():
        layer.fill_(7)
    engine.worker.restore_kv_caches()
    assert "stays off" in caplog.text

    meta, recving, invalid = engine.step(scheduler_output(), forward=True)
    assert recving == {"b"} and invalid == {10, 11, 12, 13}
    # A later load the scheduler still plans is failed, not copied.
    c = request("c", tokens)
    got, is_async = engine.sched.get_num_new_matched_tokens(c, 0)
    assert got > 0 and is_async
    engine.sched.update_state_after_alloc(c, Blocks([20, 21, 22, 23, 24]), got)
    _, recving, invalid = engine.step(scheduler_output(), forward=True)
    if "c" not in recving:
        _, recving, invalid = engine.step(scheduler_output(), forward=True)
    assert "c" in recving and {20, 21, 22, 23} <= invalid
    for layer in engine.kv.values():
        assert bool((layer == 7).all()), "kvbm wrote to the released KV cache"


def step_finalize_deferred(eng, so):
    """One step in the order of 0.33's model runner with a speculator
    (defer_finalize): the step's results are taken before its saves run,
    then wait_for_save and clear_connector_metadata (finalize_step)."""
    meta = eng.sched.build_connector_meta(so)
    w = eng.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    _, recving = w.get_finished(set(so.finished_req_ids))
    invalid = w.get_block_ids_with_load_errors()
    w.get_kv_connector_stats()
    w.build_connector_worker_meta()
    w.wait_for_save()
    w.clear_connector_metadata()
    eng.sched.update_connector_output(SimpleNamespace(finished_recving=recving, invalid_block_ids=invalid))
    return meta, recving or set(), invalid


def test_finalize_deferred_after_the_results_still_saves_and_loads(engine):
    tokens = list(range(800, 800 + 4 * BS + 2))
    a = request("a", tokens)
    assert engine.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    engine.sched.update_state_after_alloc(a, Blocks([]), 0)
    meta, _, _ = step_finalize_deferred(engine, scheduler_output(new=[(a, [1, 2, 3, 4, 5], 0)]))
    assert [s[0] for s in plan_summary(meta.plan)["saves"]] == [1, 2, 3, 4]
    assert engine.sched.request_finished(a, [1, 2, 3, 4, 5]) == (False, None)
    step_finalize_deferred(engine, scheduler_output(finished=["a"]))

    b = request("b", tokens)
    got, is_async = engine.sched.get_num_new_matched_tokens(b, 0)
    assert got == 4 * BS and is_async
    engine.sched.update_state_after_alloc(b, Blocks([10, 11, 12, 13, 14]), got)
    deadline = time.monotonic() + 60  # loads are asynchronous: wait by wall clock, not by step count
    recving, invalid = set(), set()
    while "b" not in recving and time.monotonic() < deadline:
        _, recving, invalid = step_finalize_deferred(engine, scheduler_output())
    assert recving == {"b"} and invalid == set()
    for i in range(4):
        for layer in engine.kv.values():
            assert torch.equal(layer[:, 10 + i], layer[:, 1 + i])
