"""How often one engine step crosses the C ABI with vLLM (TP=1, through
FakeVllm): the measured figures of docs/architecture.md's "Where the
languages meet". A decode step in which no block fills or is allocated, and
for which the leader queued nothing, does not cross at all (a quiet step:
the scheduler side reads Leader.step_needed from memory and sends the
tokens with the next step). Any other step crosses twice: once on the
scheduler side (kvbm_leader_step: the plan) and once on the worker side
(kvbm_worker_bind, whose answer says which of the step's other calls have
work); a step that saves a block adds kvbm_worker_wait_for_save and, for vLLM's per-step
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


def test_a_decode_step_crosses_the_abi_only_when_a_block_fills_or_is_allocated(env, crossings):  # noqa: F811
    eng = fake_vllm(token_budget=256)
    eng.report_stats = True  # both sides' get_kv_connector_stats every step, as vLLM calls them
    try:
        p = prompt(3, 5 * BS + 1)
        a = eng.add(vf.FakeRequest("a", p, max_tokens=12))
        eng.step()  # the prefill: the request's own crossings
        per_step = []
        for _ in range(8):  # decode steps: the request's tokens come one at a time
            computed = a.num_computed_tokens
            crossings.clear()
            eng.step()
            per_step.append((computed, {k: v for k, v in crossings.items() if v}))
        seen = {"save": 0, "alloc": 0, "quiet": 0}
        for computed, crossed in per_step:
            if (computed + 1) % BS == 0:  # the step computes a block's last token: it saves the block
                seen["save"] += 1
                assert crossed == {"kvbm_leader_step": 1, "kvbm_worker_bind": 1, "kvbm_worker_wait_for_save": 1,
                                   "kvbm_worker_stats": 1}, (computed, crossed)
            elif computed % BS == 0:  # its token starts a block: vLLM allocates one, the leader is told
                seen["alloc"] += 1
                assert crossed == {"kvbm_leader_step": 1, "kvbm_worker_bind": 1}, (computed, crossed)
            else:  # nothing for kvbm: the step does not cross at all
                seen["quiet"] += 1
                assert crossed == {}, (computed, crossed)
        assert seen == {"save": 2, "alloc": 2, "quiet": 4}, seen
        saved = [s for s in eng.kv_stats[-16:] if s is not None]
        assert sum(s.counter("transfer_blocks", "g1_to_g2") for s in saved) == 2, "each saved block reported"
        eng.run()
        # What was decoded across the quiet steps was saved, with the right
        # contents: the whole sequence is found again.
        full = list(a.all_token_ids)
        c = eng.add(vf.FakeRequest("c", full, max_tokens=1))
        eng.run()
        assert c.external_hits == [(len(full) - 1) // BS * BS] and eng.wrong_kv == [], c.external_hits
        eng.run()
        crossings.clear()
        steps_before = eng.steps
        eng.add(vf.FakeRequest("b", p))
        eng.run()
        # The re-visit's own crossings: its salt, its match, its allocation,
        # where its loads come from; its load is started and reported once.
        for name in ("kvbm_leader_match", "kvbm_leader_update_after_alloc", "kvbm_leader_load_sources",
                     "kvbm_worker_start_load"):
            assert crossings[name] == 1, (name, dict(crossings))
        # kvbm_worker_finished crosses in the steps while the load runs (how
        # many depends on how fast the machine copies), at most once a step.
        assert 1 <= crossings["kvbm_worker_finished"] <= eng.steps - steps_before, dict(crossings)
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


def test_a_step_is_quiet_by_the_blocks_the_leader_would_save(env):  # noqa: F811
    """The quiet check counts a request's full blocks as the leader's save
    planning does, min(computed + scheduled, tokens) / block size, against
    the last step sent: with speculative decoding, drafts are scheduled but
    not yet tokens, so a step whose drafts reach past a block's end saves
    nothing (quiet), and the step after, whose accepted tokens complete the
    block, is sent even though its own computed + scheduled stays in one block."""
    from types import SimpleNamespace

    eng = fake_vllm(token_budget=256)
    try:
        a = eng.add(vf.FakeRequest("a", prompt(3, 2 * BS + 1), max_tokens=50))
        eng.step()  # the prefill, sent: 2 full blocks computed, 2 * BS + 2 tokens
        side = eng.sched._scheduler_side
        leader = side._leader
        assert not leader.step_needed()

        def quiet(computed: int, scheduled: int) -> bool:
            so = SimpleNamespace(
                scheduled_new_reqs=[], finished_req_ids=set(), num_scheduled_tokens={"a": scheduled},
                scheduled_cached_reqs=SimpleNamespace(req_ids=["a"], new_block_ids=[None],
                                                      num_computed_tokens=[computed], resumed_req_ids=set()))
            return side._quiet(leader, so, so.num_scheduled_tokens)

        n = a.num_tokens
        assert n == 2 * BS + 2 and a.num_computed_tokens == 2 * BS + 1
        assert quiet(2 * BS + 1, 1), "a plain decode step inside block 2"
        assert quiet(2 * BS + 1, BS), "drafts reach past block 2's end, but its tokens do not: nothing to save"
        a.output.extend([11] * (BS - 1))  # accepted drafts: the tokens now fill block 2
        assert not quiet(3 * BS - 1, 1), "block 2 is complete once this step computes its last token"
        assert not quiet(2 * BS + 1, 2 * BS), "a block completes: sent"
    finally:
        eng.close()
