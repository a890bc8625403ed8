"""Rank 0's timed load batches travel to the scheduler's leader in vLLM's
worker metadata (KvbmWorkerMeta.transfer_timings), for its load-cost model
when the worker runs in another process; driven through the fake vLLM of
test_vllm_adapter.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import msgpack

from test_vllm_adapter import BS, Blocks, engine, env, offload_prompt, request, scheduler_output  # noqa: F401


def test_worker_meta_carries_the_timed_loads(engine):
    tokens = list(range(900, 900 + 4 * BS + 2))
    offload_prompt(engine, tokens, [1, 2, 3, 4, 5])
    engine.worker.build_connector_worker_meta()  # the offload's steps: saves are not load timings
    b = request("b", tokens)
    got, _ = engine.sched.get_num_new_matched_tokens(b, 0)
    assert got == 4 * BS
    engine.sched.update_state_after_alloc(b, Blocks([10, 11, 12, 13, 14]), got)
    recving: set[str] = set()
    deadline = time.monotonic() + 60
    while "b" not in recving and time.monotonic() < deadline:
        _, recving, _ = engine.step(scheduler_output(), forward=False)
    assert "b" in recving

    meta = engine.worker.build_connector_worker_meta()
    assert meta is not None and len(meta.transfer_timings) == 1
    rep = msgpack.unpackb(meta.transfer_timings[0], raw=False)
    assert rep["pid"] == os.getpid()
    assert {t["dir"] for t in rep["timings"]} == {"g2_to_g1"}
    assert all(t["bytes"] > 0 and t["secs"] >= 0 for t in rep["timings"])
    again = engine.worker.build_connector_worker_meta()
    assert again is None or not again.transfer_timings, "handed out once"

    # The leader takes them (a worker of another process: its model learns
    # from them; the Go side's test checks the model).
    rep["pid"] = os.getpid() + 1
    meta.transfer_timings = [msgpack.packb(rep)]
    engine.sched.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=None,
                                                         kv_connector_worker_meta=meta))
    assert engine.sched._scheduler_side._leader is not None, "kvbm is still on"
