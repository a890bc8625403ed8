"""Where kvbm's time goes in an engine step when nothing is reused.

One vLLM engine (CPU backend, the engine core in this process) serves the
first visits of --docs distinct documents (one request at a time, as
bench/vllm_ttft.py --cost) and then a no-reuse batch, with kvbm's connector
(or the no-op connector, --connector noop, for the same timings without
kvbm). It times every call of the worker-side connector the engine makes
(bind_connector_metadata, start_load_kv, wait_for_save, get_finished,
get_kv_connector_stats), the scheduler-side ones (the leader's), and the
engine's model execution (execute_model, which includes the worker's calls), and prints per call: count, total, mean and
max, and each one's share of the run; then per phase (first visits, the no-reuse batch) each call's time per
engine step, with the calls into Go inside the adapter's ("go: leader step", "go: leader info", "go: worker
bind": a call into Go right after the forward pass costs far more than back to back); then kvbm's Go worker's own transfer
totals per direction (blocks, batches, seconds in the copies: G1→G2 saves,
G2→G3 moves with their XXH3 checksum and disk write) and the Go runtime's
garbage collections during the run (GODEBUG=gctrace=1, read from this
process's stderr). The same sizes as bench/vllm_ttft.py --quick.

    python bench/step_profile.py [--connector kvbm|noop] [--docs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from kvbm.testing import compare  # noqa: E402

_GC = re.compile(r"^gc \d+ @[\d.]+s \d+%: ([\d.]+)\+([\d.]+)\+([\d.]+) ms clock")


class Timer:
    """Wall time of every call of a wrapped function, by name."""

    def __init__(self) -> None:
        self.phase = ""
        self.calls: dict[str, list[float]] = {}
        self.by_phase: dict[str, dict[str, list[float]]] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        calls = self.calls.setdefault(name, [])

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                calls.append(dt)
                self.by_phase.setdefault(self.phase, {}).setdefault(name, []).append(dt)

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=("kvbm", "noop"), default="kvbm")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args()

    import vllm_ttft  # the bench's model and sizes

    length, n_unique, unique_len, out_len = 1024, 4, 256, 16
    doc_blocks = length // compare.BS
    g1, host, disk = 2 * (doc_blocks + 1) + 4, 2 * doc_blocks, 4 * a.docs * doc_blocks
    model_spec = dict(vllm_ttft.SMALL, dir="/tmp/kvbm-demo-model-small")
    docs = vllm_ttft.prompts(1, a.docs, length, model_spec["vocab"])
    batch = vllm_ttft.prompts(2, n_unique, unique_len, model_spec["vocab"])

    run_dir = tempfile.mkdtemp(prefix="kvbm-profile-", dir=compare.disk_dir())
    spec: dict[str, Any] = {"engine": {"max_model_len": length + 64, "max_num_batched_tokens": 2048,
                                       "max_num_seqs": 8, "num_gpu_blocks_override": g1},
                            "kvbm": a.connector == "kvbm", "noop_connector": a.connector == "noop"}
    env = compare.harness_env(compare.column_spec("kvbm" if a.connector == "kvbm" else "no-op connector",
                                                  model_spec, spec["engine"], g1, host, disk, []), ROOT, run_dir)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               PYTHONHASHSEED="0", VLLM_LOGGING_LEVEL="WARNING", GODEBUG="gctrace=1")
    os.environ.update(env)

    # The Go runtime writes its GC trace to fd 2: keep it in a file.
    err_path = os.path.join(run_dir, "stderr.txt")
    saved_err = os.dup(2)
    err_file = open(err_path, "w")
    os.dup2(err_file.fileno(), 2)

    t_all = Timer()
    try:
        from kvbm.testing.tiny_model import make_tiny_model
        from kvbm.testing.vllm_harness import engine_kwargs
        from kvbm.vllm_integration.connector.vllm_worker import VllmConnectorWorker
        from vllm import LLM, SamplingParams

        from kvbm.vllm_integration.connector.vllm_leader import VllmConnectorLeader

        for name in ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                     "get_kv_connector_stats"):
            setattr(VllmConnectorWorker, name, t_all.wrap(name, getattr(VllmConnectorWorker, name)))
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "update_connector_output", "request_finished", "get_kv_connector_stats"):
            setattr(VllmConnectorLeader, name, t_all.wrap("leader " + name, getattr(VllmConnectorLeader, name)))
        from kvbm import _core

        # The Go calls inside them (their share of the adapter's time).
        _core.Leader.step = t_all.wrap("  go: leader step", _core.Leader.step)  # type: ignore[method-assign]
        _core.Leader.info = t_all.wrap("  go: leader info", _core.Leader.info)  # type: ignore[method-assign]
        _core.Worker.bind = t_all.wrap("  go: worker bind", _core.Worker.bind)  # type: ignore[method-assign]
        workers: list[Any] = []
        init = VllmConnectorWorker.__init__

        def keep(self: Any, *x: Any, **kw: Any) -> None:
            init(self, *x, **kw)
            workers.append(self)

        VllmConnectorWorker.__init__ = keep  # type: ignore[method-assign]
        from vllm.v1.worker import cpu_model_runner

        runner = cpu_model_runner.CPUModelRunner
        runner.execute_model = t_all.wrap("execute_model", runner.execute_model)  # type: ignore[method-assign]

        model = make_tiny_model(model_spec.pop("dir"), **{k: v for k, v in model_spec.items()})
        llm = LLM(**engine_kwargs(model, spec))
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": docs[0][:256]}], one, use_tqdm=False)  # warm-up
        for v in t_all.calls.values():
            v.clear()
        t_all.by_phase.clear()
        t_all.phase = "first visits"
        first = []
        t0 = time.perf_counter()
        for p in docs:
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
            first.append(time.perf_counter() - t)
        t_first = time.perf_counter() - t0
        t_all.phase = "no-reuse batch"
        t = time.perf_counter()
        gen = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in batch], gen, use_tqdm=False)
        t_batch = time.perf_counter() - t
        w = workers[0] if workers else None
        dirs = w._worker.stats()["directions"] if w is not None and w._worker is not None else {}
        del llm
    finally:
        os.dup2(saved_err, 2)
        err_file.close()

    gcs, other = [], []
    with open(err_path) as f:
        for line in f:
            m = _GC.match(line)
            if m:
                gcs.append([float(x) for x in m.groups()])
            elif "Traceback" in line or "Error" in line:
                other.append(line.rstrip())
    wall = t_first + t_batch
    print(f"connector {a.connector}: {a.docs} first visits of {length} tokens ({1000 * statistics.mean(first):.1f} "
          f"ms each), then {n_unique} × {unique_len} + {out_len} out ({t_batch * 1000:.0f} ms); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'call':26} {'calls':>6} {'total ms':>9} {'mean ms':>8} {'max ms':>8} {'% of run':>8}")
    for name, xs in t_all.calls.items():
        if xs:
            print(f"{name:26} {len(xs):6d} {1000 * sum(xs):9.1f} {1000 * statistics.mean(xs):8.2f} "
                  f"{1000 * max(xs):8.2f} {100 * sum(xs) / wall:7.1f}%")
    for phase, calls in t_all.by_phase.items():
        steps = len(calls.get("execute_model", [])) or 1
        print(f"{phase}: {steps} engine steps; per step, mean ms")
        for name, xs in calls.items():
            print(f"  {name:26} {1000 * sum(xs) / steps:8.3f}")
    for d, tot in sorted(dirs.items()):
        print(f"go worker {d:16} blocks {tot.get('blocks', 0):5} batches {tot.get('batches', 0):4} "
              f"{1000 * tot.get('seconds', 0):8.1f} ms in copies")
    pause = sum(g[0] + g[2] for g in gcs)
    conc = sum(g[1] for g in gcs)
    print(f"go GC: {len(gcs)} cycles since the library loaded (engine start included), stop-the-world "
          f"{pause:.2f} ms, concurrent mark {conc:.1f} ms")
    for line in other[:5]:
        print("stderr:", line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"connector": a.connector, "first_ms": [1000 * x for x in first], "batch_ms": 1000 * t_batch,
                       "calls_ms": {k: [1000 * x for x in v] for k, v in t_all.calls.items()},
                       "directions": dirs, "gc": gcs, "loadavg": os.getloadavg()}, f)


if __name__ == "__main__":
    main()
