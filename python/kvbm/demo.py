"""kvbm's main job, end to end: vLLM (CPU backend) serving a multi-turn chat
workload with and without kvbm, same engine, same G1 size, in one run.

    python -m kvbm.demo [--model small|0.5b] [--conversations 6] [--turns 4]

Every conversation shares a long system prompt; turns are interleaved across
conversations, so together they need more KV than the engine's own cache
(G1) holds and vLLM evicts. Without kvbm an evicted prefix is recomputed;
with kvbm it comes back from host memory (G2) or disk (G3).

The model is generated locally with random weights (no model hub needed);
greedy decoding, so both runs must produce identical tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    # ~25M parameters: quick on two CPU cores.
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8000, arch="qwen2"),
    "0.5b": None,  # filled from QWEN2_05B_LIKE
}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _run(spec, label):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        sp, op = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        with open(sp, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.update({k: str(v) for k, v in (spec.get("env") or {}).items()})
        env.setdefault("DYN_KVBM_DISK_CACHE_DIR", d)
        print(f"== {label}: starting vLLM (CPU backend) ...", flush=True)
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-m", "kvbm.testing.vllm_harness", sp, op], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-200:]
            if line.startswith("[chat]") or "Cache Hit Rates" in line or "kvbm leader ready" in line \
                    or "kvbm configuration" in line:
                print("   " + line.rstrip()[:200], flush=True)
        if p.wait() != 0:
            sys.stdout.write("".join(tail))
            raise SystemExit(f"{label}: vLLM run failed")
        print(f"== {label}: finished in {time.time() - t0:.0f} s", flush=True)
        with open(op) as f:
            return json.load(f)["actions"][0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--g1-blocks", type=int, default=48, help="vLLM's own KV cache, in 32-token blocks")
    ap.add_argument("--host-blocks", type=int, default=40, help="kvbm G2 (host memory) blocks")
    ap.add_argument("--disk-blocks", type=int, default=1024, help="kvbm G3 (disk) blocks")
    ap.add_argument("--skip-noop", action="store_true", help="skip the no-op connector run (saves a minute)")
    a = ap.parse_args(argv)

    from kvbm.testing.tiny_model import QWEN2_05B_LIKE

    model = dict(QWEN2_05B_LIKE) if a.model == "0.5b" else dict(MODELS[a.model])
    model["dir"] = f"/tmp/kvbm-demo-model-{a.model}"
    act = {"conversations": a.conversations, "turns": a.turns, "prefix_len": a.prefix_len, "user_len": 64,
           "reply_len": 32, "vocab": model["vocab"], "tag": "chat"}
    max_len = a.prefix_len + a.turns * 96 + 64
    engine = {"num_gpu_blocks_override": a.g1_blocks, "max_model_len": min(max_len, (a.g1_blocks - 1) * 32),
              "max_num_batched_tokens": 1024}
    if a.model == "0.5b":
        engine["dtype"] = "bfloat16"
        model["dtype"] = "bfloat16"
    kv_env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": a.host_blocks,
              "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": a.disk_blocks,
              "DYN_KVBM_CACHE_STATS_LOG_INTERVAL_SECS": 10}
    print(f"kvbm demo: {a.conversations} conversations × {a.turns} turns, shared prefix {a.prefix_len} tokens, "
          f"G1 {a.g1_blocks} blocks × 32 tokens; kvbm G2 {a.host_blocks} blocks, G3 {a.disk_blocks} blocks")
    base = _run({"model": model, "engine": engine, "kvbm": False, "actions": [act]}, "vLLM without kvbm")
    noop = None
    if not a.skip_noop:
        noop = _run({"model": model, "engine": engine, "kvbm": False, "noop_connector": True, "actions": [act]},
                    "vLLM with a no-op KV connector")
    kv = _run({"model": model, "engine": engine, "kvbm": True, "env": kv_env, "actions": [act]}, "vLLM with kvbm")

    runs = [("without kvbm", base)] + ([("no-op connector", noop)] if noop else []) + [("with kvbm", kv)]
    same = all(r["tokens"] == kv["tokens"] for _, r in runs)
    m = kv.get("metrics", {})
    dash = " | –" * (len(runs) - 1)

    def row(label, f):
        print(f"| {label} | " + " | ".join(f(r["ttft_each"]) for _, r in runs) + " |")

    print()
    print("| | " + " | ".join(n for n, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    row("requests", lambda t: str(len(t)))
    row("TTFT mean", lambda t: f"{statistics.mean(t)*1000:.0f} ms")
    row("TTFT p50", lambda t: f"{_pct(t, .5)*1000:.0f} ms")
    row("TTFT p90", lambda t: f"{_pct(t, .9)*1000:.0f} ms")
    print(f"| kvbm host (G2) hit rate{dash} | {100*m.get('kvbm_host_cache_hit_rate', 0):.1f}% |")
    print(f"| kvbm disk (G3) hit rate{dash} | {100*m.get('kvbm_disk_cache_hit_rate', 0):.1f}% |")
    print(f"| blocks onboarded G2→G1 / G3→G1{dash} | {m.get('kvbm_onboard_blocks_h2d', 0):.0f} / "
          f"{m.get('kvbm_onboard_blocks_d2d', 0):.0f} |")
    print(f"| blocks offloaded G1→G2 / G2→G3{dash} | {m.get('kvbm_offload_blocks_d2h', 0):.0f} / "
          f"{m.get('kvbm_offload_blocks_h2d', 0):.0f} |")
    print(f"| identical outputs{' |' * len(runs)} {'yes' if same else 'NO'} |")
    if noop:
        print("\nvLLM takes a different (on its CPU backend, faster) path once any KV connector is configured; "
              "the no-op connector column is that path without kvbm, so it isolates what kvbm's cache tiers add.")
    print(f"\nmodel: {a.model} {model}")
    if not same:
        raise SystemExit("outputs differ between the runs with and without kvbm")


if __name__ == "__main__":
    main()
