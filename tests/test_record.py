"""DYN_KVBM_ENABLE_RECORD: every scheduler-side connector call as one JSON
line, through vLLM's call order (FakeVllm); TensorRT-LLM's leader is covered
in test_trtllm_connector.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from kvbm import _record
from kvbm.testing import vllm_fakes as vf
from test_vllm_adapter import BS, env, fake_vllm, prompt  # noqa: F401 - env is a fixture


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def serve_twice(p):
    eng = fake_vllm()
    try:
        eng.add(vf.FakeRequest("a", p))
        eng.run()
        b = eng.add(vf.FakeRequest("b", p))
        eng.run()
        return eng, b
    finally:
        eng.close()


def test_vllm_scheduler_calls_are_recorded_with_inputs_and_outputs(env, tmp_path):
    path = tmp_path / "records.jsonl"
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    env.setenv("DYN_KVBM_RECORD_PATH", str(path))
    p = prompt(1, 5 * BS + 1)
    eng, b = serve_twice(p)
    assert b.external_hits == [5 * BS] and eng.wrong_kv == []

    recs = records(path)
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    assert {r["engine"] for r in recs} == {"vllm"}
    methods = [r["method"] for r in recs]
    # Only the scheduler side: the worker-side connector's calls are not recorded.
    assert set(methods) <= set(_record.VLLM_SCHEDULER_METHODS)
    assert methods.count("build_connector_meta") == eng.steps
    assert methods.count("update_connector_output") == eng.steps
    assert methods[-1] == "shutdown"

    matched = [r for r in recs if r["method"] == "get_num_new_matched_tokens"]
    assert [m["inputs"]["request"]["request_id"] for m in matched] == ["a", "b"]
    assert all(m["inputs"]["request"]["num_tokens"] == len(p) for m in matched)
    assert matched[0]["output"] == [0, False]
    assert matched[1]["output"] == [5 * BS, True]

    alloc = [r for r in recs if r["method"] == "update_state_after_alloc" and r["inputs"]["request"]["request_id"] == "b"]
    assert alloc, "no update_state_after_alloc for b"
    ids = alloc[0]["inputs"]["blocks"]["block_ids"]
    # One KV cache group; at least the 5 blocks kvbm loads, distinct G1 block ids.
    assert len(ids) == 1 and len(ids[0]) >= 5 and len(set(ids[0])) == len(ids[0])
    assert all(isinstance(i, int) for i in ids[0])
    assert alloc[0]["inputs"]["num_external_tokens"] == 5 * BS

    finished = [r for r in recs if r["method"] == "request_finished"]
    assert [f["inputs"]["request"]["request_id"] for f in finished] == ["a", "b"]
    meta = next(r for r in recs if r["method"] == "build_connector_meta")
    sched = meta["inputs"]["scheduler_output"]
    assert sched["scheduled_new_reqs"][0]["req_id"] == "a"
    assert sched["scheduled_new_reqs"][0]["block_ids"] == [list(range(6))]  # the fake allocates in order
    # Token lists are recorded by their length.
    assert sched["scheduled_new_reqs"][0]["prompt_token_ids"] == {"num_tokens": len(p)}


def test_recording_off_by_default(env, tmp_path):
    env.setenv("DYN_KVBM_RECORD_PATH", str(tmp_path / "records.jsonl"))
    serve_twice(prompt(2, 3 * BS))
    assert not (tmp_path / "records.jsonl").exists()
    assert _record.record_path() == str(tmp_path / "records.jsonl")
    env.delenv("DYN_KVBM_RECORD_PATH")
    assert _record.record_path() == "/tmp/records.jsonl"  # Dynamo's


def test_a_record_that_cannot_be_written_never_breaks_the_engine(env, tmp_path, caplog):
    env.setenv("DYN_KVBM_ENABLE_RECORD", "true")
    env.setenv("DYN_KVBM_RECORD_PATH", str(tmp_path))  # a directory: open fails
    p = prompt(3, 4 * BS + 1)
    with caplog.at_level(logging.WARNING, logger="kvbm"):
        eng, b = serve_twice(p)
    assert b.external_hits == [4 * BS] and eng.wrong_kv == []
    warnings = [r for r in caplog.records if "cannot write the call record" in r.getMessage()]
    assert len(warnings) == 1, "warned once"


def test_invalid_enable_record_names_the_variable(env):
    env.setenv("DYN_KVBM_ENABLE_RECORD", "maybe")
    with pytest.raises(ValueError, match="DYN_KVBM_ENABLE_RECORD"):
        fake_vllm()


def test_a_call_that_raises_is_recorded_and_still_raises(env, tmp_path):
    path = tmp_path / "r.jsonl"
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    env.setenv("DYN_KVBM_RECORD_PATH", str(path))

    class Leader:
        def request_finished(self, request, block_ids):
            raise RuntimeError("boom")

    obj = Leader()
    assert _record.record_calls(obj, "trtllm", ("request_finished", "missing"))
    with pytest.raises(RuntimeError, match="boom"):
        obj.request_finished(vf.FakeRequest("x", range(10)), [4, 5])
    (rec,) = records(path)
    assert rec["error"] == "RuntimeError: boom" and "output" not in rec
    assert rec["inputs"] == {"request": {"request_id": "x", "num_tokens": 10, "num_computed_tokens": 0},
                             "block_ids": [4, 5]}


def test_summaries_are_compact_and_json():
    assert _record.summarize(b"\x00" * 300) == {"bytes": 300}
    assert _record.summarize(vf.Blocks([3, 4])) == {"block_ids": [[3, 4]]}
    assert _record.summarize({"r1", "r0"}) == ["r0", "r1"]
    assert _record.summarize(object()) == {"type": "object"}
    cached = SimpleNamespace(all_token_ids={"r1": list(range(9))}, new_token_ids=[[5]], new_block_ids=[([7, 8],)])
    assert _record.summarize(cached) == {"type": "SimpleNamespace", "all_token_ids": {"r1": {"num_tokens": 9}},
                                         "new_token_ids": {"num_tokens": 1}, "new_block_ids": [[[7, 8]]]}
    deep = {"a": {"b": {"c": {"d": {"e": 1}}}}}
    json.dumps(_record.summarize(deep))
