"""Stand-ins for the vLLM objects the connector reads, for tests and benchmarks
that drive DynamoConnector without importing vLLM's scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any


class ConstantList:
    """vLLM's ``vllm.v1.utils.ConstantList``: a read-only view of ``_x``."""

    def __init__(self, x: Sequence[int]) -> None:
        self._x = x

    def __len__(self) -> int:
        return len(self._x)

    def __getitem__(self, i: Any) -> Any:
        return self._x[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._x)


def vllm_config(block_size: int) -> SimpleNamespace:
    """The parts of ``VllmConfig`` the connector reads: kvbm as the KV
    connector, prefix caching on, TP=1, no KV events."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_connector="DynamoConnector", kv_role="kv_both",
                                           kv_connector_module_path="kvbm.vllm_integration.connector",
                                           kv_connector_extra_config={}),
        kv_events_config=None,
    )


def kv_cache_config(num_blocks: int, block_size: int, layers: int, heads: int, head_dim: int,
                    groups: int = 1, dtype_bytes: int = 2) -> SimpleNamespace:
    """vLLM's ``KVCacheConfig``: ``groups`` KV cache groups (more than one is a
    hybrid model), each with ``layers`` attention layers."""
    page = 2 * block_size * heads * head_dim * dtype_bytes  # K and V
    per_group = []
    for g in range(groups):
        names = [f"model.layers.{g * layers + i}.self_attn.attn" for i in range(layers)]
        per_group.append(SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=page, block_size=block_size),
                                         layer_names=names))
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=per_group)


class Blocks:
    """vLLM's ``KVCacheBlocks`` with one KV cache group."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int]]:
        return (list(self.ids),)


# vLLM's RequestStatus values the fake scheduler uses.
WAITING, WAITING_FOR_REMOTE_KVS, RUNNING, PREEMPTED, FINISHED = (
    "WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED")


class FakeRequest:
    """The attributes of vLLM's ``Request`` the connector reads, and the
    scheduler state the fake scheduler keeps for it."""

    def __init__(self, request_id: str, prompt: Iterable[int], max_tokens: int = 2, **extra: Any) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.output: list[int] = []
        self.max_tokens = max_tokens
        self.cache_salt = extra.pop("cache_salt", None)
        self.lora_request = extra.pop("lora_request", None)
        self.priority = extra.pop("priority", 0)
        self.mm_features = extra.pop("mm_features", None)
        self.prompt_embeds = extra.pop("prompt_embeds", None)
        assert not extra, extra
        self.status = WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.blocks: list[int] = []
        self.scheduled_once = False
        self.load_failed = False
        self.external_hits: list[int] = []  # tokens promised by the connector, per admission
        self.loads_promised = 0  # asynchronous loads vLLM waited for

    @property
    def all_token_ids(self) -> ConstantList:
        return ConstantList(self.prompt + self.output)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


def _token_value(prefix_hash: int, layer: int, kv: int) -> float:
    # Integers below 2048 are exact in float16.
    return float((prefix_hash * 31 + layer * 7 + kv * 3) % 1999 - 999)


class FakeVllm:
    """vLLM's scheduler and one worker (TP=1) around a scheduler-side and a
    worker-side ``DynamoConnector``, calling the connector as vLLM 0.1x's
    ``Scheduler`` and ``KVConnectorModelRunnerMixin`` do, in their order:

    * admission of a waiting request with nothing computed:
      ``get_num_new_matched_tokens`` then, once its blocks are allocated,
      ``update_state_after_alloc``; an asynchronous hit parks the request in
      WAITING_FOR_REMOTE_KVS until a worker reports it in ``finished_recving``;
    * per step: ``build_connector_meta``; on the worker
      ``bind_connector_metadata``, ``start_load_kv``, the forward pass (writes
      the scheduled tokens' KV), ``wait_for_save``, ``get_finished``,
      ``get_block_ids_with_load_errors``, ``clear_connector_metadata``; then
      ``update_connector_output``; with :attr:`report_stats` set, also both
      sides' ``get_kv_connector_stats`` every step, as vLLM's model runner
      (after ``get_finished``) and scheduler (after
      ``update_connector_output``) do, kept in :attr:`kv_stats`;
    * chunked prefill under a per-step token budget; preemption (the newest
      running request) when G1 has no free block, resumption through the
      connector again; ``request_finished`` when a request finishes or is
      aborted (an aborted WAITING_FOR_REMOTE_KVS request keeps its blocks
      until its load is reported).

    Like vLLM's scheduler it asserts that a worker reports a load only for a
    request it knows. The KV written for a token is a function of the token
    prefix, so every block a load fills is checked against what the forward
    pass would have written (:attr:`wrong_kv` lists mismatches); freed G1
    blocks are scribbled over, so a late save or load is caught too.
    G1 has no prefix cache of its own: every hit is the connector's."""

    def __init__(self, connector_cls: Callable[..., Any], config: Any, kv_cache_config: Any,
                 kv_caches: dict[str, Any], *, token_budget: int = 64,
                 scheduler_role: str = "SCHEDULER", worker_role: str = "WORKER") -> None:
        self.bs = int(config.cache_config.block_size)
        self.kv = kv_caches
        self.layers = list(kv_caches)
        self.sched = connector_cls(config, SimpleNamespace(name=scheduler_role), kv_cache_config)
        self.worker = connector_cls(config, SimpleNamespace(name=worker_role), kv_cache_config)
        self.worker.register_kv_caches(kv_caches)
        # vLLM's EngineCore then hands what the workers' connectors report
        # (tp rank → handshake metadata) to the scheduler's, before any step.
        get_hs = getattr(self.worker, "get_handshake_metadata", None)
        set_hs = getattr(self.sched, "set_xfer_handshake_metadata", None)
        if get_hs is not None and set_hs is not None:
            md = get_hs()
            if md is not None:
                set_hs({0: md})
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.free = list(range(self.num_blocks))
        self.budget = token_budget
        self.report_stats = False
        self.kv_stats: list[Any] = []
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.finished_recving: set[str] = set()
        self.finished_req_ids: set[str] = set()
        self.done: dict[str, FakeRequest] = {}
        self.wrong_kv: list[tuple[str, int]] = []
        self.recving_reports: list[str] = []
        self.steps = 0
        self.last_meta: Any = None
        self.metas: list[Any] = []  # connector metadata, per step
        self.outputs: list[SimpleNamespace] = []  # scheduler outputs, per step
        # Run after build_connector_meta with (fake, metadata).
        self.after_schedule: Callable[[FakeVllm, Any], None] | None = None

    # ---------------------------------------------------------------- requests

    def add(self, req: FakeRequest) -> FakeRequest:
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: str) -> None:
        """vLLM's ``finish_requests`` (status FINISHED_ABORTED)."""
        req = self.requests[rid]
        if req.status == FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        delay = req.status == WAITING_FOR_REMOTE_KVS and rid not in self.finished_recving
        self.finished_recving.discard(rid)
        self._finish(req, delay)

    def _finish(self, req: FakeRequest, delay: bool = False) -> None:
        req.status = FINISHED
        pending, _ = self.sched.request_finished(req, list(req.blocks))
        self.finished_req_ids.add(req.request_id)
        self.done[req.request_id] = req
        if not (delay or pending):
            self._free_blocks(req)

    def _free_blocks(self, req: FakeRequest) -> None:
        for b in req.blocks:
            for t in self.kv.values():
                t[:, b].fill_(1234.0)  # reused by another request at once
        self.free.extend(req.blocks)
        req.blocks = []
        self.requests.pop(req.request_id, None)

    def _alloc(self, req: FakeRequest, num_tokens: int) -> list[int] | None:
        need = -(-num_tokens // self.bs) - len(req.blocks)
        if need <= 0:
            return []
        if need > len(self.free):
            return None
        new, self.free = self.free[:need], self.free[need:]
        req.blocks += new
        return new

    # ------------------------------------------------------------------- KV

    def _prefix_hashes(self, tokens: Iterable[int]) -> list[int]:
        h, out = 17, []
        for t in tokens:
            h = (h * 1000003 + t + 1) % (1 << 61)
            out.append(h)
        return out

    def _forward(self, req: FakeRequest, start: int, n: int) -> None:
        hashes = self._prefix_hashes(list(req.all_token_ids)[:start + n])
        for p in range(start, start + n):
            b, off = req.blocks[p // self.bs], p % self.bs
            for li, name in enumerate(self.layers):
                for kv in (0, 1):
                    self.kv[name][kv, b, :, off, :] = _token_value(hashes[p], li, kv)

    def _check_loaded(self, req: FakeRequest, upto: int) -> None:
        hashes = self._prefix_hashes(list(req.all_token_ids)[:upto])
        for p in range(upto):
            b, off = req.blocks[p // self.bs], p % self.bs
            for li, name in enumerate(self.layers):
                for kv in (0, 1):
                    if not bool((self.kv[name][kv, b, :, off, :] == _token_value(hashes[p], li, kv)).all()):
                        self.wrong_kv.append((req.request_id, p))
                        return

    # -------------------------------------------------------------- schedule

    def _schedule(self) -> SimpleNamespace:
        budget = self.budget
        new_reqs: list[FakeRequest] = []
        cached: list[tuple[FakeRequest, list[int] | None, bool]] = []  # None: preempted meanwhile
        num_sched: dict[str, int] = {}
        preempted_now: list[FakeRequest] = []
        for req in list(self.running):
            if req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while (new := self._alloc(req, req.num_computed_tokens + n)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now.append(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            cached.append((req, new, False))
            num_sched[req.request_id] = n
            budget -= n
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req in preempted_now:
                continue
            if req.status == WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving:
                    continue
                self.finished_recving.discard(req.request_id)
                if not req.load_failed:
                    self._check_loaded(req, req.num_computed_tokens)
                elif req.num_computed_tokens == 0:
                    self._free_blocks_keep(req)  # nothing valid: vLLM frees them and matches again
                req.load_failed = False
                if req.num_computed_tokens == req.num_tokens:
                    req.num_computed_tokens -= 1
                req.status = PREEMPTED if req.num_preemptions else WAITING
            ext, is_async = 0, False
            if req.num_computed_tokens == 0:
                ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
                if ext is None:  # the connector's lookup still runs: vLLM skips it and asks next step
                    continue
                req.external_hits.append(ext)
            n = 0 if is_async else min(req.num_tokens - req.num_computed_tokens - ext, budget)
            if self._alloc(req, req.num_computed_tokens + ext + n) is None:
                break
            self.sched.update_state_after_alloc(req, Blocks(req.blocks), ext)
            self.waiting.remove(req)
            if is_async:
                req.loads_promised += 1
                req.status = WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = ext
                self.waiting.append(req)
                continue
            if ext:  # a synchronous hit: the blocks are the worker's to fill this step
                req.num_computed_tokens += ext
            resumed = req.status == PREEMPTED and req.scheduled_once
            req.status = RUNNING
            self.running.append(req)
            if resumed:
                cached.append((req, list(req.blocks), True))
            else:
                new_reqs.append(req)
            req.scheduled_once = True
            num_sched[req.request_id] = n
            budget -= n
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, prompt_token_ids=list(r.prompt),
                                                block_ids=(list(r.blocks),),
                                                num_computed_tokens=r.num_computed_tokens) for r in new_reqs],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.request_id for r, _, _ in cached],
                resumed_req_ids={r.request_id for r, _, res in cached if res},
                new_token_ids=[[] for _ in cached],
                new_block_ids=[(list(b),) if b else None for _, b, _ in cached],
                num_computed_tokens=[r.num_computed_tokens for r, _, _ in cached]),
            num_scheduled_tokens=num_sched,
            finished_req_ids=set(self.finished_req_ids),
            preempted_req_ids={r.request_id for r in preempted_now},
        )
        self.finished_req_ids.clear()
        return so

    def _preempt(self, req: FakeRequest) -> None:
        self._free_blocks_keep(req)
        req.status = PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def _free_blocks_keep(self, req: FakeRequest) -> None:
        for b in req.blocks:
            for t in self.kv.values():
                t[:, b].fill_(1234.0)
        self.free.extend(req.blocks)
        req.blocks = []

    # ----------------------------------------------------------------- step

    def step(self) -> Any:
        """One engine step. Returns the connector metadata it built."""
        so = self._schedule()
        self.outputs.append(so)
        meta = self.sched.build_connector_meta(so)
        self.last_meta = meta
        self.metas.append(meta)
        if self.after_schedule is not None:
            # What arrives while the step runs (an abort, a failure), as
            # with vLLM's asynchronous scheduling.
            self.after_schedule(self, meta)
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        scheduled = [(self.requests[rid], n) for rid, n in so.num_scheduled_tokens.items()
                     if n > 0 and rid in self.requests and self.requests[rid].status == RUNNING]
        for req, n in scheduled:
            self._forward(req, req.num_computed_tokens, n)
        w.wait_for_save()
        sending, recving = w.get_finished(set(so.finished_req_ids))
        if self.report_stats:
            self.kv_stats.append(w.get_kv_connector_stats())
        invalid = w.get_block_ids_with_load_errors() or set()
        w.clear_connector_metadata()
        for req, n in scheduled:  # sampling
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.output.append((req.num_tokens * 7 + 3) % 997)
                if len(req.output) >= req.max_tokens:
                    self.running.remove(req)
                    self._finish(req)
        out = SimpleNamespace(finished_recving=recving, finished_sending=sending, invalid_block_ids=invalid,
                              kv_connector_worker_meta=w.build_connector_worker_meta())
        self.sched.update_connector_output(out)
        if self.report_stats:
            self.kv_stats.append(self.sched.get_kv_connector_stats())
        # kv_load_failure_policy "recompute": a loading request keeps the
        # valid prefix before its first failed block.
        for req in self.requests.values():
            if invalid and req.status == WAITING_FOR_REMOTE_KVS:
                bad = [i for i, b in enumerate(req.blocks) if b in invalid]
                if bad:
                    req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * self.bs)
                    req.load_failed = True
        for rid in recving or ():
            self.recving_reports.append(rid)
            assert rid in self.requests, f"finished_recving names {rid!r}, which the scheduler does not hold"
            req = self.requests[rid]
            if req.status == WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
            else:
                assert req.status == FINISHED, (rid, req.status)
                self._free_blocks(req)
        for rid in sending or ():
            self._free_blocks(self.requests[rid])
        self.steps += 1
        return meta

    def idle(self) -> bool:
        return not self.waiting and not self.running and len(self.free) == self.num_blocks

    def run(self, timeout: float = 60.0) -> None:
        """Steps until every request finished and released its blocks. Loads
        complete asynchronously, so the bound is wall time, not steps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
                return
            self.step()
        raise AssertionError(f"not done after {timeout} s ({self.steps} steps): waiting "
                             f"{[(r.request_id, r.status) for r in self.waiting]}, running "
                             f"{[r.request_id for r in self.running]}, {self.num_blocks - len(self.free)} "
                             "G1 blocks held")

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()
