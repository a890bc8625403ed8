"""Load or recompute: TTFT of re-visited prompts whose KV is in G4 (a real
S3 server, versitygw, behind kvbm.testing.delay_proxy adding 0, 20 and
100 ms to every S3 request), vLLM's CPU backend, same run:

  recompute   no kvbm: every re-visit is computed (the baseline: recompute
              only, nothing of kvbm in the path; the proxy delay does not
              touch it, so it is measured once)
  always      kvbm, DYN_KVBM_LOAD_POLICY=always: every G4 hit is loaded
  cost        kvbm, DYN_KVBM_LOAD_POLICY=cost: load only where loading is
              expected to beat computing (docs/design.md §4.1)

One engine fills the bucket with K prompts. Every other column is a fresh
engine (empty G1 and G2, no G3) on that bucket: it computes a prompt of its
own first (the prefill step the cost model measures), then re-visits the K
prompts one at a time (max_tokens=1: the request's wall time is its TTFT).
The first G4 load of an engine is taken whatever the policy (a tier never
measured is loaded: that measures it), so the median is over all K
re-visits, the first included. The model is MLP-heavy (as in the e2e test),
so computing a token costs far more than moving its KV. Every re-visit's
output token is compared with the recompute column's.

    python bench/load_policy.py [--quick] [--docs K]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import rows  # noqa: E402  (bench/rows.py)

from kvbm.testing.compare import run_harness  # noqa: E402
from kvbm.testing.delay_proxy import DelayProxy  # noqa: E402
from kvbm.testing.s3server import S3Server, binary  # noqa: E402

BS = 32
BUCKET = "kvbm-loadpolicy"
DELAYS_MS = (0, 20, 100)
BLOCKS = 12  # full blocks a prompt


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(BLOCKS * BS + 5)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 re-visited prompts instead of 8")
    ap.add_argument("--docs", type=int, default=0, help="re-visited prompts (default 8, --quick 4)")
    a = ap.parse_args()
    k = a.docs or (4 if a.quick else 8)
    if binary() is None:
        print("load_policy: versitygw not installed (run .ci/s3-server.sh): no G4, no table", file=sys.stderr)
        return 1
    docs = [prompt(100 + i) for i in range(k)]
    with tempfile.TemporaryDirectory(prefix="kvbm-loadpolicy-") as tmp:
        srv = S3Server.create(os.path.join(tmp, "s3"))
        proxy = DelayProxy(srv.port)
        try:
            model = {"dir": os.path.join(tmp, "model"), "intermediate": 16384}
            env = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 64, **srv.env(BUCKET),
                   "DYN_KVBM_OBJECT_ENDPOINT": f"http://127.0.0.1:{proxy.port}"}
            fill = run_harness({"model": model, "env": env, "actions": [
                {"generate": docs, "max_tokens": 1, "tag": "fill"},
                {"s3_objects": srv.state_dir, "bucket": BUCKET, "at_least": k * BLOCKS, "tag": "stored"}]},
                "fill the bucket")
            if not fill["actions"][1]["reached"]:
                raise SystemExit(f"load_policy: the bucket did not get {k * BLOCKS} objects")
            seed = [1000]

            def column(label: str, col_env: dict | None) -> dict:
                seed[0] += 1  # each engine's warm prompt is its own (it reaches the bucket)
                acts = [{"generate": [prompt(seed[0])], "max_tokens": 1, "tag": "warm"},
                        {"each": docs, "max_tokens": 1, "progress": True, "tag": "revisit"}]
                spec = {"model": model, "actions": acts}
                if col_env is None:
                    spec["kvbm"] = False
                else:
                    spec["env"] = col_env
                res: dict = run_harness(spec, label)["actions"][1]
                return res

            ref = column("recompute (no kvbm)", None)
            results = {}
            for d in DELAYS_MS:
                proxy.delay = d / 1000
                for pol in ("always", "cost"):
                    results[(d, pol)] = column(f"{pol}, G4 +{d} ms", {**env, "DYN_KVBM_LOAD_POLICY": pol})
        finally:
            proxy.close()
            srv.stop()

    def med(r: dict) -> float:
        return statistics.median(r["secs_each"]) * 1000

    def loaded(r: dict) -> str:
        got = sum(c or 0 for c in r["num_cached_tokens"])
        return f"{got // BS}/{k * BLOCKS}"

    wrong = [f"{pol} +{d} ms" for (d, pol), r in results.items() if r["tokens"] != ref["tokens"]]
    print(f"\nRe-visit TTFT, median of {k} prompts of {BLOCKS * BS + 5} tokens (ms); blocks loaded from G4 / "
          "re-visited blocks. Baseline: recompute = no kvbm (measured once: no G4 in its path).")
    print(f"{'G4 delay/request':>16} {'recompute':>10} {'always':>10} {'loaded':>8} {'cost':>10} {'loaded':>8}"
          f" {'cost vs best other':>19}")
    for d in DELAYS_MS:
        al, co = results[(d, "always")], results[(d, "cost")]
        best = min(med(ref), med(al))
        ratio = best / med(co)
        words = f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.2f}× slower"
        print(f"{d:>13} ms {med(ref):>10.0f} {med(al):>10.0f} {loaded(al):>8} {med(co):>10.0f} {loaded(co):>8}"
              f" {words:>19}")
        rows.emit("load_policy", f"re-visit TTFT, G4 +{d} ms/request (cost policy)", f"{med(co):.0f} ms",
                  f"recompute {med(ref):.0f} ms, always {med(al):.0f} ms", words)
    print("outputs identical to recompute in every column" if not wrong else f"OUTPUT MISMATCH: {', '.join(wrong)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
