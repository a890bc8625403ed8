"""vLLM (CPU backend) with vs without kvbm, measured in one run.

1. Re-visited long prompts: N prompts of L tokens (L ≥ 2K) are sent once,
   then again after G1 (the engine's own KV cache, capped small) has evicted
   them. TTFT of the second visit: with kvbm (loaded from G2) vs without
   (recomputed). Target: ≥ 3× faster with kvbm.
2. No reuse at all: unique prompts, generation throughput (tokens/s) with vs
   without kvbm. Target: ≥ 95% (kvbm's write-through overhead ≤ 5%).

The model has the dimensions of a ~0.5B-parameter LLM (Qwen2-0.5B: hidden
896, 24 layers, 14 heads, 2 KV heads) with random weights, so the ratio of
compute to KV size is that of a real small model.

    python bench/vllm_ttft.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from kvbm.testing.tiny_model import QWEN2_05B_LIKE  # noqa: E402

BS = 32


def prompts(seed, n, length, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(length)] for _ in range(n)]


def run_harness(spec, label):
    with tempfile.TemporaryDirectory() as d:
        sp, op = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        with open(sp, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.update({k: str(v) for k, v in (spec.get("env") or {}).items()})
        t = time.time()
        print(f"== {label}: starting vLLM ...", flush=True)
        p = subprocess.run([sys.executable, "-m", "kvbm.testing.vllm_harness", sp, op], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout.splitlines():
            if line.startswith("[") and "request" in line or "Cache Hit Rates" in line:
                print("   " + line[:160], flush=True)
        if p.returncode != 0:
            print(p.stdout[-5000:])
            raise SystemExit(f"{label}: harness failed")
        print(f"== {label}: done in {time.time() - t:.0f}s", flush=True)
        with open(op) as f:
            return json.load(f)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    ap.add_argument("--model-dir", default="/tmp/kvbm-bench-qwen2-05b-like")
    ap.add_argument("--order", default="without,with,without",
                    help="engine runs in order; 'without' twice brackets the kvbm run so that drift on a "
                         "shared machine shows (the better 'without' run is the baseline)")
    a = ap.parse_args()
    n_long, length = (3, 2048) if a.quick else (4, 2048 + 16)
    n_unique, unique_len, out_len = (4, 256, 16) if a.quick else (8, 384, 32)
    vocab = QWEN2_05B_LIKE["vocab"]
    model = dict(QWEN2_05B_LIKE, dir=a.model_dir, dtype="bfloat16")
    longs = prompts(1, n_long, length, vocab)
    uniques = prompts(2, n_unique, unique_len, vocab)
    warm_uniques = prompts(3, n_unique, unique_len, vocab)
    uniques_2 = prompts(4, n_unique, unique_len, vocab)
    g1_blocks = (length // BS + 2) * 2 + 4  # room for ~two long prompts: the rest are evicted
    engine = {"num_gpu_blocks_override": g1_blocks, "max_model_len": length + 64, "max_num_batched_tokens": 2048,
              "dtype": "bfloat16", "max_num_seqs": 8}
    actions = [
        {"each": [longs[0][:256]], "max_tokens": 1, "tag": "warmup"},
        {"each": longs, "max_tokens": 1, "tag": "first_visit", "progress": True},
        {"each": longs, "max_tokens": 1, "tag": "revisit", "progress": True},
        {"generate": warm_uniques, "max_tokens": out_len, "tag": "no_reuse_warmup"},
        {"generate": uniques, "max_tokens": out_len, "tag": "no_reuse"},
        {"generate": uniques_2, "max_tokens": out_len, "tag": "no_reuse_2"},
    ]
    runs = {"without": [], "with": []}
    for i, which in enumerate(a.order.split(",")):
        use = which.strip() == "with"
        spec = {"model": model, "engine": engine, "kvbm": use, "actions": actions,
                "env": {"DYN_KVBM_CPU_CACHE_GB": "4"} if use else {}}
        label = f"run {i + 1}: {'with' if use else 'without'} kvbm"
        runs["with" if use else "without"].append({x["tag"]: x for x in run_harness(spec, label)["actions"]})

    def total(r):
        return sum(r["first_visit"]["secs_each"]) + r["no_reuse"]["secs"] + r["no_reuse_2"]["secs"]

    # The faster of the runs of each kind: the machine may be shared, and
    # interference only ever slows a run down.
    base = min(runs["without"], key=total)
    kv = min(runs["with"], key=total)
    if len(runs["without"]) > 1:
        print("baseline runs (first visit mean, no-reuse tok/s): " + ", ".join(
            f"{statistics.mean(r['first_visit']['secs_each'])*1000:.0f} ms / "
            f"{n_unique * out_len / r['no_reuse']['secs']:.1f}" for r in runs["without"]))
    for tag in ("revisit",):
        assert base[tag]["tokens"] == kv[tag]["tokens"], "outputs differ with kvbm"
    rb, rk = base["revisit"]["secs_each"], kv["revisit"]["secs_each"]
    fb, fk = base["first_visit"]["secs_each"], kv["first_visit"]["secs_each"]
    ntok = n_unique * out_len
    # Two measured batches of unique prompts per engine; the better of the two
    # is reported for each (the machine is shared; the max is the least noisy).
    tb = max(ntok / base[t]["secs"] for t in ("no_reuse", "no_reuse_2"))
    tk = max(ntok / kv[t]["secs"] for t in ("no_reuse", "no_reuse_2"))
    m = kv["no_reuse"].get("metrics", {})
    print()
    print(f"model: Qwen2-0.5B-like (hidden {QWEN2_05B_LIKE['hidden']}, {QWEN2_05B_LIKE['layers']} layers, "
          f"{QWEN2_05B_LIKE['heads']} heads, {QWEN2_05B_LIKE['kv_heads']} KV heads), random weights, bf16, "
          f"vLLM CPU backend, block {BS}, G1 {g1_blocks} blocks, kvbm G2 4 GB")
    print()
    print(f"| workload | without kvbm | with kvbm | ratio | target |")
    print(f"|---|---|---|---|---|")
    print(f"| first visit, TTFT mean ({n_long} × {length} tokens) | {statistics.mean(fb)*1000:.0f} ms | "
          f"{statistics.mean(fk)*1000:.0f} ms | {statistics.mean(fb)/statistics.mean(fk):.2f}× | ≈1× |")
    print(f"| re-visit after G1 eviction, TTFT mean | {statistics.mean(rb)*1000:.0f} ms | "
          f"{statistics.mean(rk)*1000:.0f} ms | {statistics.mean(rb)/statistics.mean(rk):.1f}× faster | ≥ 3× |")
    print(f"| re-visit, TTFT p50 / max | {pct(rb,.5)*1000:.0f} / {max(rb)*1000:.0f} ms | "
          f"{pct(rk,.5)*1000:.0f} / {max(rk)*1000:.0f} ms | | |")
    print(f"| no reuse ({n_unique} × {unique_len} prompt + {out_len} out), throughput | {tb:.1f} tok/s | "
          f"{tk:.1f} tok/s | {100*tk/tb:.0f}% | ≥ 95% |")
    print()
    print(f"kvbm counters at the end: offload d2h {m.get('kvbm_offload_blocks_d2h', 0):.0f}, "
          f"onboard h2d {m.get('kvbm_onboard_blocks_h2d', 0):.0f}, matched tokens {m.get('kvbm_matched_tokens', 0):.0f}")


if __name__ == "__main__":
    main()
