"""How often one engine step crosses the C ABI with vLLM (TP=1, through
FakeVllm): the measured baseline of docs/architecture.md's "Where the
languages meet". A step crosses once on the scheduler side (the plan) and
four times on the worker side (bind, start_load, wait_for_save, finished);
a request crosses a few more times on its own (match, allocation, load
sources, finish). A change that adds a crossing to every step fails here and
updates that section."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest

from kvbm import _native
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
    yield counts


def test_steps_cross_the_abi_five_times(env, crossings):  # noqa: F811
    eng = fake_vllm(token_budget=256)
    try:
        p = prompt(3, 5 * BS + 1)
        eng.add(vf.FakeRequest("a", p, max_tokens=12))
        eng.step()  # the prefill: the request's own crossings
        crossings.clear()
        steps = 0
        for _ in range(8):  # decode steps: the request's tokens come one at a time
            eng.step()
            steps += 1
        per_step = {"kvbm_leader_step", "kvbm_worker_bind", "kvbm_worker_start_load", "kvbm_worker_wait_for_save",
                    "kvbm_worker_finished"}
        assert {k for k, v in crossings.items() if v} <= per_step | {"kvbm_leader_request_finished"}
        for name in per_step:
            assert crossings[name] == steps, (name, dict(crossings))
        eng.run()
        crossings.clear()
        eng.add(vf.FakeRequest("b", p))
        eng.run()
        # The re-visit's own crossings: its salt, its match, its allocation, where its loads come from.
        for name in ("kvbm_leader_match", "kvbm_leader_update_after_alloc", "kvbm_leader_load_sources"):
            assert crossings[name] == 1, (name, dict(crossings))
    finally:
        eng.close()
