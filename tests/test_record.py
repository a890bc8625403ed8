"""DYN_KVBM_ENABLE_RECORD: every scheduler-side connector call as one JSON
line, through vLLM's call order (FakeVllm); TensorRT-LLM's leader is covered
in test_trtllm_connector.py."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import threading
from types import SimpleNamespace

import pytest

from kvbm import _record
from kvbm.testing import vllm_fakes as vf
from test_vllm_adapter import BS, env, fake_vllm, prompt  # noqa: F401 - env is a fixture


def records(path):
    _record.flush()  # records are written by a background thread
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


class _Leader:
    """A scheduler-side object with one recorded method."""

    def request_finished(self, request, block_ids):
        return False, None


def _record_one(request_id="r"):
    """record_calls on a fresh object, one call through it, the record
    flushed; returns whether recording is on."""
    obj = _Leader()
    on = _record.record_calls(obj, "trtllm", ("request_finished",))
    assert obj.request_finished(vf.FakeRequest(request_id, range(4)), [1]) == (False, None)
    _record.flush()
    return on


def _warnings(caplog, what):
    return [r for r in caplog.records if what in r.getMessage()]


def test_a_symlink_at_the_record_path_is_not_followed(env, tmp_path, caplog):
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    target = tmp_path / "victim"
    target.write_text("keep\n")
    target.chmod(0o600)
    link = tmp_path / "records.jsonl"
    link.symlink_to(target)
    env.setenv("DYN_KVBM_RECORD_PATH", str(link))
    with caplog.at_level(logging.WARNING, logger="kvbm"):
        on = _record_one()
        _record_one()
    assert target.read_text() == "keep\n", "the symlink's target was written"
    assert not on
    assert len(_warnings(caplog, "cannot write the call record")) == 1, "warned once"

    # A dangling symlink: the file it names is not created.
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "created-through-link")
    env.setenv("DYN_KVBM_RECORD_PATH", str(dangling))
    assert not _record_one()
    assert not (tmp_path / "created-through-link").exists()


def test_a_fifo_record_path_never_blocks_the_call(env, tmp_path, caplog):
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    env.setenv("DYN_KVBM_RECORD_PATH", str(fifo))
    result = {}
    t = threading.Thread(target=lambda: result.update(on=_record_one()), daemon=True)
    with caplog.at_level(logging.WARNING, logger="kvbm"):
        t.start()
        t.join(timeout=30)  # liveness: the call returns at all, not how fast
    try:
        assert not t.is_alive(), "the recorded call blocked on the FIFO"
    finally:
        if t.is_alive():  # let the stuck open return, so the process can exit
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert result == {"on": False}
    assert len(_warnings(caplog, "cannot write the call record")) == 1

    # With a reader on the FIFO the open succeeds, and the file is refused: not a regular file.
    fifo2 = tmp_path / "read.fifo"
    os.mkfifo(fifo2)
    env.setenv("DYN_KVBM_RECORD_PATH", str(fifo2))
    r = os.open(fifo2, os.O_RDONLY | os.O_NONBLOCK)
    try:
        t = threading.Thread(target=lambda: result.update(on=_record_one()), daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "the recorded call blocked on the FIFO"
        assert result == {"on": False}
        assert os.read(r, 4096) == b"", "a record was written into the FIFO"
    finally:
        os.close(r)


def test_only_a_private_regular_file_of_this_user_is_written(env, tmp_path, caplog):
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    new = tmp_path / "new.jsonl"
    env.setenv("DYN_KVBM_RECORD_PATH", str(new))
    old_umask = os.umask(0)
    try:
        assert _record_one()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o600, "created readable by others"
    assert len(records(new)) == 1

    existing = tmp_path / "existing.jsonl"
    existing.write_text("")
    existing.chmod(0o644)  # not group/other writable: appended to
    env.setenv("DYN_KVBM_RECORD_PATH", str(existing))
    assert _record_one()
    assert len(records(existing)) == 1

    shared = tmp_path / "shared.jsonl"
    shared.write_text("keep\n")
    shared.chmod(0o666)
    linked = tmp_path / "linked.jsonl"
    other_name = tmp_path / "other-name"
    other_name.write_text("keep\n")
    other_name.chmod(0o600)
    os.link(other_name, linked)  # two names: writing one would change the other
    with caplog.at_level(logging.WARNING, logger="kvbm"):
        for p in (shared, linked):
            env.setenv("DYN_KVBM_RECORD_PATH", str(p))
            assert not _record_one()
            assert p.read_text() == "keep\n"
    msgs = [r.getMessage() for r in _warnings(caplog, "cannot write the call record")]
    assert len(msgs) == 2
    assert "writable by group or others" in msgs[0] and "links" in msgs[1]


def test_client_request_ids_are_written_as_json_strings(env, tmp_path):
    path = tmp_path / "records.jsonl"
    env.setenv("DYN_KVBM_ENABLE_RECORD", "1")
    env.setenv("DYN_KVBM_RECORD_PATH", str(path))
    pwned = tmp_path / "pwned"
    ids = [f'$(touch {pwned})"\n{{', f"`touch {pwned}`'\\", "\u2028x\x00\x1b[2J"]
    for rid in ids:
        _record_one(rid)
    raw = path.read_bytes()
    lines = raw.decode("ascii").split("\n")
    assert lines[-1] == "" and len(lines) == 1 + len(ids), "one line per record, nothing raw"
    got = [json.loads(line)["inputs"]["request"]["request_id"] for line in lines[:-1]]
    assert got == ids
    # Nothing a shell would expand: a file sourced by mistake runs nothing.
    assert b"$" not in raw and b"`" not in raw
    subprocess.run(["sh", "-c", '. "$1"', "sh", str(path)], capture_output=True, timeout=60)
    assert not pwned.exists(), "sourcing the record ran a request id"


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path, caplog):
    path = tmp_path / "records.jsonl"
    sink = _record._Sink(str(path), capacity=2)
    assert sink.open()
    entered, release = threading.Event(), threading.Event()
    write = sink._write_lines

    def slow_write(lines):  # a disk that does not answer
        entered.set()
        release.wait()
        write(lines)

    sink._write_lines = slow_write
    sink.start()
    sink.submit({"method": "m", "i": 0})
    assert entered.wait(timeout=30), "the writer never took the first record"
    with caplog.at_level(logging.WARNING, logger="kvbm"):
        t = threading.Thread(target=lambda: [sink.submit({"method": "m", "i": i}) for i in range(1, 6)],
                             daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "submit blocked on a full queue"
    assert sink.dropped == 3
    assert len(_warnings(caplog, "dropping")) == 1, "warned once"
    release.set()
    assert sink.flush(timeout=30)
    sink.submit({"method": "m", "i": 6})  # room again
    assert sink.flush(timeout=30) and sink.dropped == 3
    recs = records(path)
    # The dropped calls leave gaps in seq.
    assert [(r["seq"], r["i"]) for r in recs] == [(0, 0), (1, 1), (2, 2), (6, 6)]
