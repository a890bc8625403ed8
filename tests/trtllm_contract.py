"""A stand-in for TensorRT-LLM's PyExecutor that drives kvbm's TensorRT-LLM
connector in the engine's per-iteration order, without TensorRT-LLM.

What it reproduces (see /work/shared/reference/trtllm.md §1.5-1.6 and
TensorRT-LLM's kv_cache_connector.py):

* the leader (``DynamoKVBMConnectorLeader``) lives in this process, as on rank 0;
* every rank's worker (``DynamoKVBMConnectorWorker``) runs in its own process
  (multiprocessing "spawn"), with its own CPU tensor standing in for the GPU
  primary pool [num_blocks, num_layers, 2, heads_per_rank*tokens_per_block*head_dim]
  and its own shard bytes (every rank writes different bytes for the same token
  prefix, as TP ranks hold different heads);
* per iteration: admission (``get_num_new_matched_tokens`` then
  ``update_state_after_alloc`` with all prompt blocks), ``SchedulerOutput`` built
  like ``KvCacheConnectorSchedulerOutputManager`` (new requests once, deltas
  after; loading requests left out; chunked prefill; optional overlap-scheduler
  token lag; optional whole-list block resends), ``build_connector_meta`` once,
  the metadata pickled to every worker (MPI bcast), ``start_load_kv``, per layer
  ``wait_for_layer_load`` / the layer's KV writes / ``save_kv_layer``, the
  forward-pass callable, ``wait_for_save``, sampling, ``request_finished``,
  then ``get_finished`` on every rank with the manager's bookkeeping (an id is
  returned by the engine only once every rank returned it; returning an id that
  was never passed in is an error, as it is a KeyError in TensorRT-LLM).

KV contents are a function of (rank, token prefix), so a block loaded from
kvbm can be checked byte for byte against what the forward pass wrote for the
same prefix. Freed G1 blocks are scribbled over at once (another request
reusing them), so a save that ran late would be caught.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

# ----------------------------------------------------------- engine objects


@dataclass
class RequestData:
    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list = field(default_factory=list)
    priorities: Optional[list] = None
    cache_salt: Optional[str] = None
    cache_salt_id: Optional[int] = None


@dataclass
class RequestData12:
    """TensorRT-LLM 1.2's RequestData: no priorities, no cache salt."""

    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int


# The connector API versions the stand-in reproduces:
# * "1.2": RequestData12; SchedulerOutput lists context requests in schedule
#   order, then generation requests; wait_for_initialization is never called.
# * "main": RequestData with per-block retention priorities (None without a
#   retention config) and cache_salt_id; ScheduledRequests splits context
#   requests into those still chunking and those on their last chunk, and
#   the manager lists context_requests_chunking + context_requests_last_chunk,
#   then generation requests; wait_for_initialization follows
#   register_kv_caches.
APIS = ("1.2", "main")


@dataclass
class SchedulerOutput:
    new_requests: list = field(default_factory=list)
    cached_requests: list = field(default_factory=list)


class _Mapping:
    def __init__(self, rank, tp):
        self.rank, self.tp_size, self.pp_size, self.cp_size, self.world_size = rank, tp, 1, 1, tp


class _ParallelConfig:
    def __init__(self, rank, tp):
        self.tp_size, self.pp_size, self._rank = tp, 1, rank

    def to_mapping(self):
        return _Mapping(self._rank, self.tp_size)


def make_llm_args(spec: dict, rank: int = 0):
    """TorchLlmArgs-shaped settings (only what the connector reads)."""
    return SimpleNamespace(
        model=spec.get("model_dir"),
        backend="pytorch",
        max_beam_width=spec.get("max_beam_width", 1),
        enable_attention_dp=False,
        tensor_parallel_size=spec["tp"],
        pipeline_parallel_size=spec.get("pp", 1),
        parallel_config=_ParallelConfig(rank, spec["tp"]),
        scheduler_config=SimpleNamespace(capacity_scheduler_policy=spec.get("policy", "GUARANTEED_NO_EVICT")),
        kv_cache_config=SimpleNamespace(
            tokens_per_block=spec["bs"], enable_block_reuse=True, enable_partial_reuse=False,
            host_cache_size=spec.get("host_cache_size"), dtype="auto",
        ),
        kv_connector_config=SimpleNamespace(
            connector_module="kvbm.trtllm_integration.connector",
            connector_scheduler_class="DynamoKVBMConnectorLeader",
            connector_worker_class="DynamoKVBMConnectorWorker",
        ),
    )


def write_model_config(path: str, spec: dict) -> None:
    """A config.json the leader reads its bytes per block from."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"num_hidden_layers": spec["layers"], "num_attention_heads": spec["kv_heads"],
                   "num_key_value_heads": spec["kv_heads"], "head_dim": spec["head_dim"],
                   "hidden_size": spec["kv_heads"] * spec["head_dim"], "torch_dtype": "float16"}, f)


def prefix_key(tokens) -> str:
    return hashlib.blake2b(repr(list(tokens)).encode(), digest_size=12).hexdigest()


class FakeLlmRequest:
    """The attributes of TensorRT-LLM's LlmRequest the connector reads."""

    def __init__(self, request_id: int, tokens, max_new: int):
        self.request_id = request_id
        self.py_request_id = request_id
        self.tokens = list(tokens)
        self.max_new = max_new
        self.generated = 0
        self.blocks: list[int] = []
        self.phase = "waiting"  # waiting, loading, context, generation, saving, done
        self.ctx_pos = 0
        self.device_hit = 0
        self.matched = 0
        self.rep_tokens = 0
        self.rep_blocks = 0
        self.reported = False
        self.sampled_iter = -1
        self.lora_task_id = None
        self.cache_salt_id = None  # u64, derived by the LLM API from the request's salt string
        # KvCacheRetentionConfig as the KV cache manager resolves it: the
        # retention priority of block i is retention[min(i, len - 1)]; None
        # without a retention config.
        self.retention: Optional[list] = None

    def block_priority(self, i: int) -> int:
        return self.retention[min(i, len(self.retention) - 1)]

    def get_tokens(self, beam: int):
        assert beam == 0
        return list(self.tokens)


# ------------------------------------------------------------ worker process


def _content(torch, rank: int, key: str, shape):
    seed = int.from_bytes(hashlib.blake2b(f"{rank}:{key}".encode(), digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16)


class WorkerSide:
    """One rank: the worker connector and its stand-in GPU tensor."""

    def __init__(self):
        import torch

        self.torch = torch
        self.w = self.kv = self.cb = None
        self.rank = 0

    def _content(self, key):
        return _content(self.torch, self.rank, key, self.kv.shape[1:])

    def handle(self, cmd, args):
        torch = self.torch
        if cmd == "init":
            from kvbm.trtllm_integration.connector import DynamoKVBMConnectorWorker

            spec, env, self.rank = args
            self.shutdown()
            if env is not None:
                for k in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
                    del os.environ[k]
                os.environ.update(env)
            self.w = DynamoKVBMConnectorWorker(make_llm_args(spec, self.rank))
            self.cb = self.w.register_forward_pass_callable()
            inner = (spec["kv_heads"] // spec["tp"]) * spec["bs"] * spec["head_dim"]
            kv = torch.empty((spec["num_blocks"], spec["layers"], 2, inner), dtype=torch.float16)
            self.kv = kv.view(torch.int16)
            self.kv.random_(-32768, 32767, generator=torch.Generator().manual_seed(1000 + self.rank))
            self.w.register_kv_caches(kv)
            return self.w._worker.info() if self.w._worker is not None else None
        if cmd == "step":
            meta, writes, forward = args
            self.w.bind_connector_meta(meta)
            self.w.start_load_kv(None)
            if forward:
                contents = {b: self._content(key) for b, key in writes}
                for layer in range(self.kv.shape[1]):
                    self.w.wait_for_layer_load(layer, None)
                    for b, c in contents.items():
                        self.kv[b, layer] = c[layer]
                    self.w.save_kv_layer(layer, None)
                if self.cb is not None:
                    self.cb()
                self.w.wait_for_save(None)
            return None
        if cmd == "write":
            for b, key in args:
                self.kv[b] = self._content(key)
            return None
        if cmd == "get_finished":
            return self.w.get_finished(*args)
        if cmd == "check":
            return [b for b, key in args if not torch.equal(self.kv[b], self._content(key))]
        if cmd == "scribble":
            for b in args:
                self.kv[b].random_(-32768, 32767)
            return None
        if cmd == "failed":
            return self.w._failed
        raise ValueError(f"unknown command {cmd}")

    def shutdown(self):
        if self.w is not None:
            self.w.shutdown()
            self.w = None


def _worker_main(conn):
    side = WorkerSide()
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            side.shutdown()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", side.handle(cmd, args)))
        except Exception as e:  # noqa: BLE001 - report to the test
            import traceback

            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class InProcessPool:
    """Rank 0 only, in this process (the leader's process, as in TensorRT-LLM)."""

    def __init__(self):
        self.side = WorkerSide()
        self.workers = [self.side]

    def all(self, cmd, args_for_rank):
        return [self.side.handle(cmd, args_for_rank(0))]

    def close(self):
        self.side.shutdown()


class MixedPool:
    """TensorRT-LLM's layout of processes at TP>1: rank 0's worker in this
    process (the leader's, as MPI rank 0 runs the scheduler and its own model
    shard), every other rank in a process of its own."""

    def __init__(self, n: int):
        self.side = WorkerSide()
        ctx = mp.get_context("spawn")
        self.procs = [WorkerProc(ctx) for _ in range(n - 1)]
        self.workers = [self.side, *self.procs]

    def all(self, cmd, args_for_rank):
        args = [args_for_rank(r) for r in range(len(self.workers))]
        if cmd == "init":
            # The other processes need this process's environment (the
            # leader's settings, set by the test just before).
            args = [(a[0], a[1] if a[1] is not None or r == 0 else dict(os.environ), a[2])
                    for r, a in enumerate(args)]
        for r, w in enumerate(self.procs, start=1):
            w.send(cmd, args[r])
        first = self.side.handle(cmd, args[0])
        return [first, *(w.recv() for w in self.procs)]

    def close(self):
        self.side.shutdown()
        for w in self.procs:
            w.close()


class WorkerProc:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()

    def send(self, cmd, args=None):
        self.conn.send((cmd, args))

    def recv(self, timeout=120):
        if not self.conn.poll(timeout):
            raise TimeoutError("worker process did not answer")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker failed: {out}")
        return out

    def call(self, cmd, args=None):
        self.send(cmd, args)
        return self.recv()

    def close(self):
        try:
            self.call("close")
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


class WorkerPool:
    """N worker processes, started once and re-initialised per scenario."""

    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self.workers = [WorkerProc(ctx) for _ in range(n)]

    def all(self, cmd, args_for_rank):
        for r, w in enumerate(self.workers):
            w.send(cmd, args_for_rank(r))
        return [w.recv() for w in self.workers]

    def close(self):
        for w in self.workers:
            w.close()


# ------------------------------------------------------------------- engine


class Engine:
    """One TensorRT-LLM instance: the leader here, the workers in processes."""

    def __init__(self, leader, pool: WorkerPool, spec: dict, *, chunk: int | None = None, overlap: bool = False,
                 resend_blocks: bool = False, api: str = "main"):
        assert api in APIS, api
        self.api = api
        self.leader = leader
        self.pool = pool
        self.bs = spec["bs"]
        self.free = list(range(spec["num_blocks"]))
        self.chunk = chunk
        self.overlap = overlap
        self.resend = resend_blocks
        self.waiting: list[FakeLlmRequest] = []
        self.active: list[FakeLlmRequest] = []
        self.finished: list[FakeLlmRequest] = []
        self.iter = 0
        n = len(pool.workers)
        # KvCacheConnectorManager's bookkeeping, per rank.
        self.new_loading: list[int] = []
        self.new_saving: list[int] = []
        self.pending = [{"saving": set(), "loading": set()} for _ in range(n)]
        self.local_done = [{"saving": set(), "loading": set()} for _ in range(n)]
        self.plans: list[bytes] = []
        self.loads_finished: dict[int, int] = {}  # request id → iteration its load was released
        self.events: list[tuple] = []
        self.on_loaded = None  # callback(request) when a load is released on all ranks
        self.outputs: list[SchedulerOutput] = []
        if api == "main":
            # PyExecutor, once every rank registered its KV cache.
            leader.wait_for_initialization()

    # -- helpers
    def alloc(self, n: int) -> list[int]:
        assert len(self.free) >= n, "G1 exhausted"
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, r: FakeLlmRequest) -> None:
        blocks, r.blocks = r.blocks, []
        # Another request reuses them at once: any save still reading them
        # would copy garbage.
        self.pool.all("scribble", lambda _: blocks)
        self.free.extend(blocks)

    def submit(self, r: FakeLlmRequest, device_hit_blocks: int = 0) -> FakeLlmRequest:
        r.device_hit = device_hit_blocks * self.bs
        self.waiting.append(r)
        return r

    def key(self, r: FakeLlmRequest, end: int) -> str:
        return prefix_key(r.tokens[:end])

    def _next_token(self, r: FakeLlmRequest) -> int:
        return int.from_bytes(hashlib.blake2b(repr(r.tokens[-3:]).encode(), digest_size=4).digest(), "little") % 30000

    # -- one iteration of PyExecutor._executor_loop
    def step(self) -> None:
        self.iter += 1
        bs = self.bs
        # 1. admission (KVCacheManager.prepare_resources → add_sequence).
        for r in list(self.waiting):
            need = math.ceil((len(r.tokens) + r.max_new - r.generated) / bs)
            if len(self.free) < need:
                break
            self.waiting.remove(r)
            r.blocks = self.alloc(math.ceil(len(r.tokens) / bs))
            if r.device_hit:
                # Device prefix-cache hit: those blocks already hold the prefix.
                self.pool.all("write", lambda _: [(r.blocks[i], self.key(r, (i + 1) * bs))
                                                  for i in range(r.device_hit // bs)])
            n, is_async = self.leader.get_num_new_matched_tokens(r, r.device_hit)
            assert not (n == 0 and is_async), "(0, True) is illegal"
            assert n % bs == 0 and r.device_hit + n < len(r.tokens), (n, r.device_hit, len(r.tokens))
            r.matched = n
            self.leader.update_state_after_alloc(r, list(r.blocks))
            r.ctx_pos = r.device_hit + n
            if is_async:
                r.phase = "loading"
                self.new_loading.append(r.request_id)
            else:
                r.phase = "context"
            self.active.append(r)

        # 2. build_scheduler_output.
        so = SchedulerOutput()
        scheduled = []
        writes = []
        chunking, last_chunk, generation = [], [], []
        for r in self.active:
            if r.phase == "context":
                sched = len(r.tokens) - r.ctx_pos
                if self.chunk:
                    sched = min(sched, self.chunk)
                rd = self._request_data(r, r.tokens, r.ctx_pos, sched)
                lo, hi = r.ctx_pos, r.ctx_pos + sched
                (chunking if self.api == "main" and hi < len(r.tokens) else last_chunk).append((r, rd))
            elif r.phase == "generation":
                pos = len(r.tokens) - 1
                if pos // bs >= len(r.blocks):
                    r.blocks += self.alloc(1)
                visible = r.tokens[:-1] if self.overlap and r.sampled_iter == self.iter - 1 else r.tokens
                rd = self._request_data(r, visible, len(visible) - 1, 1)
                lo, hi = pos, pos + 1
                generation.append((r, rd))
            else:
                continue
            scheduled.append((r, hi))
            for i in range(lo // bs, (hi - 1) // bs + 1):
                writes.append((r.blocks[i], self.key(r, min((i + 1) * bs, hi))))
        for r, rd in chunking + last_chunk + generation:
            (so.new_requests if not r.reported else so.cached_requests).append(rd)
            r.reported = True
        self.outputs.append(so)

        # 3. _kv_connector_start_batch (only when something was scheduled,
        # loading requests included) and the forward pass.
        if scheduled or self.new_loading:
            meta = self.leader.build_connector_meta(so)
            assert isinstance(meta, bytes)
            self.plans.append(meta)
            meta = pickle.loads(pickle.dumps(meta))  # mpi_broadcast
            self.pool.all("step", lambda _: (meta, writes, bool(scheduled)))

        # 4. sampling and responses.
        for r, hi in scheduled:
            if r.phase == "context":
                r.ctx_pos = hi
                if hi < len(r.tokens):
                    continue
                r.phase = "generation"
            r.tokens.append(self._next_token(r))
            r.generated += 1
            r.sampled_iter = self.iter
            if r.generated >= r.max_new:
                self.active.remove(r)
                if self.leader.request_finished(r, list(r.blocks)):
                    r.phase = "saving"
                    self.new_saving.append(r.request_id)
                    self.active.append(r)
                else:
                    r.phase = "done"
                    self.release(r)
                    self.finished.append(r)

        # 5. _kv_connector_terminate_requests → get_finished on every rank.
        self._get_finished()

    def _request_data(self, r, visible, computed, sched) -> RequestData:
        new_tokens = list(visible[r.rep_tokens:])
        r.rep_tokens = max(r.rep_tokens, len(visible))
        new_blocks = list(r.blocks) if (self.resend and r.reported) else list(r.blocks[r.rep_blocks:])
        first_new = len(r.blocks) - len(new_blocks)
        r.rep_blocks = len(r.blocks)
        if self.api == "1.2":
            return RequestData12(r.request_id, new_tokens, new_blocks, computed, sched)
        prios = None if r.retention is None else [r.block_priority(first_new + i) for i in range(len(new_blocks))]
        return RequestData(r.request_id, new_tokens, new_blocks, computed, sched, priorities=prios,
                           cache_salt_id=r.cache_salt_id)

    def _get_finished(self) -> None:
        saving, loading = self.new_saving, self.new_loading
        self.new_saving, self.new_loading = [], []
        for p in self.pending:
            p["saving"].update(saving)
            p["loading"].update(loading)
        results = self.pool.all("get_finished", lambda _: (list(saving), list(loading)))
        for rank, (done_saving, done_loading) in enumerate(results):
            for kind, ids in (("saving", done_saving), ("loading", done_loading)):
                for rid in ids:
                    # TensorRT-LLM: `del self.saving[req_id]` → KeyError.
                    assert rid in self.pending[rank][kind], f"rank {rank} returned {kind} id {rid} not pending"
                    self.pending[rank][kind].discard(rid)
                    self.local_done[rank][kind].add(rid)
        for kind in ("saving", "loading"):
            both = set.intersection(*[d[kind] for d in self.local_done])
            for d in self.local_done:
                d[kind] -= both
            for rid in both:
                r = next(x for x in self.active if x.request_id == rid)
                if kind == "loading":
                    r.phase = "context"
                    self.loads_finished[rid] = self.iter
                    if self.on_loaded:
                        self.on_loaded(r)
                else:
                    self.active.remove(r)
                    r.phase = "done"
                    self.release(r)
                    self.finished.append(r)

    # -- scenario helpers
    def run(self, max_iters: int = 500, timeout_s: float = 60.0) -> None:
        """Iterate until every request is done. Loads run in the background, so
        iterations that only wait for them (as TensorRT-LLM's loop does) do not
        count against max_iters; timeout_s bounds the whole run."""
        import time

        deadline = time.monotonic() + timeout_s
        busy = 0
        while self.waiting or self.active:
            if busy >= max_iters or time.monotonic() > deadline:
                raise AssertionError(f"engine did not drain: {busy} iterations, waiting={len(self.waiting)} "
                                     f"active={[(r.request_id, r.phase) for r in self.active]}")
            idle = all(r.phase in ("loading", "saving") for r in self.active) and not self.waiting
            self.step()
            if idle:
                time.sleep(0.001)
            else:
                busy += 1

    def preempt(self, r: FakeLlmRequest) -> None:
        """Reset a running request (its allocation dies) and replay it: newer
        TensorRT-LLM then reports it as a new request with all its tokens."""
        assert r.phase in ("context", "generation")
        self.active.remove(r)
        self.release(r)
        r.phase, r.reported, r.rep_tokens, r.rep_blocks, r.ctx_pos = "waiting", False, 0, 0, 0
        self.waiting.insert(0, r)

    def check_prefix(self, r: FakeLlmRequest, first_block: int, last_block: int) -> None:
        """Every rank's G1 blocks [first, last) of r hold its prefix's bytes."""
        pairs = [(r.blocks[i], self.key(r, (i + 1) * self.bs)) for i in range(first_block, last_block)]
        bad = self.pool.all("check", lambda _: pairs)
        assert all(not b for b in bad), f"request {r.request_id}: blocks differ per rank: {bad}"


def saves_of(plans) -> list:
    from kvbm._adapter_common import plan_summary

    return [s for p in plans for s in plan_summary(p)["saves"]]
