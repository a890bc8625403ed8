"""How often one engine step crosses the C ABI with vLLM (TP=1, through
FakeVllm): the measured figures of docs/architecture.md's "Where the
languages meet". A decode step crosses twice: once on the scheduler side
(kvbm_leader_step: the plan) and once on the worker side (kvbm_worker_bind,
whose answer says which of the step's other calls have work); a step that
saves a block adds kvbm_worker_wait_for_save and, for vLLM's per-step
connector stats, kvbm_worker_stats (the totals are read only after a batch
was recorded; the leader's figures are read from memory Go keeps current,
without a call), a step with loads adds
kvbm_worker_start_load and, until they finished, kvbm_worker_finished. The
plan is decoded once, in Go (bind). A request crosses a few more times on
its own (match, allocation, load sources, finish), and its tokens once. A
change that adds a crossing to every step fails here and updates that
section."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest

from kvbm import _native, _plan
from kvbm.testing import vllm_fakes as vf
from test_vllm_adapter import BS, env, fake_vllm, prompt  # noqa: F401 (env: the fixture)


@pytest.fixture
def crossings(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    counts: collections.Counter[str] = collections.Counter()
    call = _native.call

    def counting(name: str, *args: object) -> None:
        counts[name] += 1
        call(name, *args)

    monkeypatch.setattr(_native, "call", counting)
    for name in ("decode", "group_rows", "with_group_rows", "load_targets"):  # Python reading a plan
        fn = getattr(_plan, name)

        def reading(*args: object, _fn=fn, _name=name) -> object:
            counts["python_plan_" + _name] += 1
            return _fn(*args)

        monkeypatch.setattr(_plan, name, reading)
    yield counts


def test_a_decode_step_crosses_the_abi_twice(env, crossings):  # noqa: F811
    eng = fake_vllm(token_budget=256)
    eng.report_stats = True  # both sides' get_kv_connector_stats every step, as vLLM calls them
    try:
        p = prompt(3, 5 * BS + 1)
        eng.add(vf.FakeRequest("a", p, max_tokens=12))
        eng.step()  # the prefill: the request's own crossings
        crossings.clear()
        steps = 8
        for _ in range(steps):  # decode steps: the request's tokens come one at a time
            eng.step()
        # Over 8 decode steps from 5 * BS + 1 tokens, blocks become full at
        # tokens 6 * BS and 7 * BS: two steps save a block.
        saving_steps = 2
        assert {k for k, v in crossings.items() if v} <= {
            "kvbm_leader_step", "kvbm_worker_bind", "kvbm_worker_wait_for_save", "kvbm_worker_stats"}, dict(crossings)
        assert crossings["kvbm_leader_step"] == steps, dict(crossings)
        assert crossings["kvbm_worker_bind"] == steps, dict(crossings)
        assert crossings["kvbm_worker_wait_for_save"] == saving_steps, dict(crossings)
        assert crossings["kvbm_worker_stats"] == saving_steps, dict(crossings)
        saved = [s for s in eng.kv_stats[-2 * steps:] if s is not None]
        assert sum(s.counter("transfer_blocks", "g1_to_g2") for s in saved) == saving_steps, "each saved block reported"
        eng.run()
        crossings.clear()
        eng.add(vf.FakeRequest("b", p))
        eng.run()
        # The re-visit's own crossings: its salt, its match, its allocation,
        # where its loads come from; its load is started and reported once.
        for name in ("kvbm_leader_match", "kvbm_leader_update_after_alloc", "kvbm_leader_load_sources",
                     "kvbm_worker_start_load"):
            assert crossings[name] == 1, (name, dict(crossings))
        # kvbm_worker_finished crosses in the steps while the load runs (how
        # many depends on how fast the machine copies), at most once a step.
        assert 1 <= crossings["kvbm_worker_finished"] <= crossings["kvbm_leader_step"], dict(crossings)
        assert not any(k.startswith("python_plan_") for k in crossings), dict(crossings)
        # A request with nothing to load: no step of it asks for finished loads.
        crossings.clear()
        eng.add(vf.FakeRequest("c", prompt(4, 3 * BS + 1)))
        eng.run()
        assert crossings["kvbm_leader_step"] >= 1, dict(crossings)
        assert crossings["kvbm_worker_finished"] == 0, dict(crossings)
        assert crossings["kvbm_worker_start_load"] == 0, dict(crossings)
    finally:
        eng.close()


def test_a_matched_prompt_crosses_once(env, crossings, monkeypatch):  # noqa: F811
    from kvbm._core import Leader

    rows: list[list[object]] = []
    step = Leader.step

    def spying(self: Leader, updates, *args: object, **kw: object) -> bytes:
        rows.extend(list(u) for u in updates)
        return step(self, updates, *args, **kw)

    monkeypatch.setattr(Leader, "step", spying)
    eng = fake_vllm(token_budget=256)
    try:
        p = prompt(5, 4 * BS + 2)
        eng.add(vf.FakeRequest("a", p, max_tokens=2))
        eng.run()
        first = [r for r in rows if r[0] == "a"][0]
        # Matched: the leader kept the prompt, the first row carries none of it.
        assert first[8] == len(p) and first[1] == [], first
    finally:
        eng.close()
