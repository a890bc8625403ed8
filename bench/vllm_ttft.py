"""vLLM (CPU backend) with kvbm against three baselines and two peers, same
prompts, same run.

Columns (kvbm.testing.compare): no kvbm; a no-op KV connector (vLLM's
connector code path without kvbm: it tells kvbm's own cost from that path's);
no kvbm with G1 enlarged by exactly kvbm's G2 bytes (on the CPU backend G1 is
host memory, so this is "give vLLM the memory instead"); kvbm (same G1, G2 in
host memory, G3 on disk, every block written through to disk). Peers
(kvbm.testing.peers; --no-peers leaves them out): LMCache (vLLM's
LMCacheMPConnector and an `lmcache server` with kvbm's host bytes as its L1
and kvbm's disk bytes as an O_DIRECT disk tier; from .venv-lmcache, which
scripts/lmcache-env.sh creates: without it the column says so and the bench
goes on), and vLLM's own OffloadingConnector with kvbm's host bytes (vLLM
refuses it on the CPU backend: the column then shows that start-up error).
Every column is its own engine process with the same core reservation, and
re-visit outputs are compared across all of them.

1. Re-visited documents: K distinct documents of L tokens are sent once, then
   again in a shuffled order. K × L is more than G1 + kvbm's G2 bytes can hold,
   so the enlarged-G1 baseline cannot keep them all either; kvbm keeps the rest
   on disk (G3). TTFT of the re-visits, hit rates per tier, and 16 output
   tokens per re-visit compared across every column. Headline: kvbm against
   the strongest baseline. Target: ≥ 3× faster.
2. No reuse at all: unique prompts, generation throughput (tokens/s).
   Target: ≥ 95% of the strongest baseline (kvbm's write-through cost ≤ 5%).

The model (random weights, generated locally) is a ~25M-parameter Qwen2-like
one by default; --model 0.5b has Qwen2-0.5B's dimensions (hidden 896, 24
layers, 14 heads, 2 KV heads; bf16), for a machine with more cores. --model
sliding is the small model's size with Gemma-3-like attention: every other
layer attends within a 256-token sliding window, so vLLM's hybrid KV cache
manager gives it two KV cache groups; it adds a column, kvbm with the hybrid
manager off (one group, full-size KV for every layer: what vLLM does with a
connector that cannot handle groups), and a row of the bytes kvbm stored per
prompt token in both kvbm columns. --model state is the small model's size
as an LFM2-like hybrid: short-convolution state layers and full attention in
turn (a MambaSpec group beside the attention group, vLLM's prefix caching of
state on); a re-visit resumes from the state kvbm stored where the first
visit's prefill step ended. --quick uses 1K-token documents instead of 2K.

3. --cost: only kvbm's cost when nothing is reused (first visits and
   no-reuse throughput of kvbm, of kvbm with its threads left on the
   model's cores, of kvbm with G2 only, of the no-op connector, of no
   connector and of LMCache unless --no-peers), paired: the
   engines run side by side and every request goes to each in turn;
   --repeat rounds (default 3) of fresh engines and prompts; verdicts from
   the paired ratios' 95% interval (met, not met, or not decided).

    python bench/vllm_ttft.py [--quick] [--repeat N] [--model small|0.5b|sliding|state] [--docs N] [--no-peers] [--cost]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import rows  # noqa: E402  (bench/rows.py)

from kvbm.testing import compare, peers  # noqa: E402
from kvbm.testing.tiny_model import QWEN2_05B_LIKE  # noqa: E402

SMALL = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8000, arch="qwen2")
SLIDING = dict(SMALL, arch="llama", sliding_window=256)
STATE = dict(SMALL, arch="lfm2")
CHECK_TOKENS = 16
NO_REUSE_BATCHES = 5  # --cost: measured no-reuse batches per round (after one warm-up batch)


def faster(ratio):
    """A time ratio (baseline / kvbm) in words."""
    return f"{ratio:.1f}× faster" if ratio >= 1 else f"{1 / ratio:.1f}× slower"


def prompts(seed, n, length, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(length)] for _ in range(n)]


def fastest_runs(tries, cols, machine_time):
    """Per column, the run (of tries: one {column: record} per round) whose
    machine_time was least; a column that failed in every round keeps its
    error."""
    out = {}
    for c in cols:
        ok = [t[c] for t in tries if "error" not in t[c]]
        out[c] = min(ok, key=machine_time) if ok else tries[0][c]
    return out


def spread(xs):
    """mean and min–max of a list, as text."""
    return f"{statistics.mean(xs):.1f} (min {min(xs):.1f}, max {max(xs):.1f}, n {len(xs)})"


def cost(a, model, mname, engine, g1, host, disk, docs, length, n_unique, unique_len, out_len, vocab):
    """kvbm's cost when nothing is reused: first visits and no-reuse
    throughput of kvbm, kvbm with its threads on the model's cores (before
    DYN_KVBM_THREAD_AFFINITY), kvbm with G2 only (no disk tier: what the
    G2→G3 moves cost), the no-op connector and no connector, and LMCache
    (unless --no-peers; left out, with the reason, where it cannot run).

    Paired and interleaved: every round starts all the engines at once
    (compare.LiveColumn) and sends each request to each of them in turn
    (order rotated per request), one engine working at a time, so a request
    and its pairs in the other columns run seconds apart on the same machine;
    slow drifts of a shared machine then hit all columns alike. After each
    request the kvbm columns wait until their background work (G2→G3 moves)
    is done, so none of it runs during another column's request (the time it
    took is printed). Each round has fresh documents and prompts (a first
    visit is one). The verdicts use the paired ratios of all rounds: their
    geometric mean and 95% bootstrap interval (compare.paired_ratio)."""
    cols = ["no kvbm", "no-op connector", "kvbm", compare.KVBM_INHERIT, compare.KVBM_G2_ONLY]
    if not a.no_peers:
        cols.append(peers.LMCACHE)  # the peer a user would pick instead, measured in the same pairs
    n = max(a.repeat, 1)
    print(f"vLLM no-reuse cost: {mname} model; per round {len(docs)} first visits of {length}-token documents and "
          f"{NO_REUSE_BATCHES} batches of {n_unique} × {unique_len} prompts + {out_len} out, nothing reused; {n} round(s), the "
          f"engines of {', '.join(cols)} running side by side, each request sent to every engine in turn",
          flush=True)
    print(compare.engine_threads(), flush=True)
    first = {c: [] for c in cols}  # ms, per request, every round
    tput = {c: [] for c in cols}  # tok/s, per batch, every round
    settle = {c: [] for c in cols}  # s kvbm's background work ran on after a request
    ntok = n_unique * out_len
    for k in range(n):
        # The warm-up request is a prompt of its own (with --model state a
        # document's head would be re-visited from a state computed two ways).
        warm = prompts(900 + k, 1, 256, vocab)[0]
        round_docs = prompts(100 + k, len(docs), length, vocab)
        batches = [prompts(200 + 10 * k + b, n_unique, unique_len, vocab) for b in range(1 + NO_REUSE_BATCHES)]
        live = {}
        try:
            print(f"== round {k + 1}/{n}", flush=True)
            live, failed = compare.start_columns(cols, model, engine, g1, host, disk)
            for c in failed:  # a peer that cannot run: left out of every round, so the pairs stay aligned
                cols.remove(c)
                del first[c], tput[c], settle[c]

            def one(c, act):
                rec = live[c].do(act)
                t0 = time.time()
                live[c].do({"quiesce": True, "tag": "quiesce"})
                settle[c].append(time.time() - t0)
                return rec

            for c in cols:
                one(c, {"each": [warm], "max_tokens": 1, "tag": "warmup"})
            for j, d in enumerate(round_docs):
                m = (j + k) % len(cols)
                for c in cols[m:] + cols[:m]:
                    first[c].append(1000 * one(c, {"each": [d], "max_tokens": 1, "tag": "first_visit"})["secs_each"][0])
                print(f"   first visit {j + 1}/{len(round_docs)}: " +
                      ", ".join(f"{c} {first[c][-1]:.0f} ms" for c in cols), flush=True)
            for b, batch in enumerate(batches):  # batch 0 warms the decode path up
                m = (b + k) % len(cols)
                for c in cols[m:] + cols[:m]:
                    rec = one(c, {"generate": batch, "max_tokens": out_len, "tag": f"no_reuse_{b}"})
                    if b:
                        tput[c].append(ntok / rec["secs"])
        finally:
            for c in live.values():
                c.close()
        per = len(round_docs)
        print(f"round {k + 1}/{n}: " + "; ".join(
            f"{c}: first visit {statistics.mean(first[c][-per:]):.1f} ms, "
            f"{statistics.mean(tput[c][-NO_REUSE_BATCHES:]):.1f} tok/s"
            for c in cols), flush=True)
    print()
    compare.print_table([
        ("first visit, TTFT per request, ms", first, spread),
        ("no reuse, tok/s per batch", tput, spread),
        ("background work after a request (quiesce), s", settle, lambda xs: f"{statistics.mean(xs):.2f}"),
    ], cols)
    print(f"paired ratios, {n} round(s): geometric mean and 95% bootstrap interval; target ≥ 95%")
    verdicts = {}
    for kv, bases in (("kvbm", ("no-op connector", "no kvbm", compare.KVBM_G2_ONLY)),
                      (compare.KVBM_INHERIT, ("no-op connector", "no kvbm")),
                      (compare.KVBM_G2_ONLY, ("no-op connector",)),
                      ("kvbm", (peers.LMCACHE,))):
        for base in bases:
            if base not in cols:
                continue
            f = compare.paired_ratio([first[base][i] / first[kv][i] for i in range(len(first[kv]))])
            t = compare.paired_ratio([tput[kv][i] / tput[base][i] for i in range(len(tput[kv]))])
            for what, (m, lo, hi) in (("first visits (speed)", f), ("no-reuse throughput", t)):
                v = compare.verdict(lo, hi, 0.95)
                verdicts[(kv, base, what)] = (m, lo, hi, v)
                word = {True: "met", False: "NOT met", None: "not decided (the interval spans 95%)"}[v]
                if base == compare.KVBM_G2_ONLY:  # the disk tier's share of kvbm's cost: no target
                    word = "the G2→G3 moves' share"
                print(f"  {kv} against {base}: {what} {100 * m:.1f}% ({100 * lo:.1f}–{100 * hi:.1f}%): {word}")
    for what, short in (("first visits (speed)", "first-visit TTFT"), ("no-reuse throughput", "throughput")):
        m, lo, hi, v = verdicts[("kvbm", "no-op connector", what)]
        base = statistics.mean(first["no-op connector"]) if short != "throughput" else statistics.mean(
            tput["no-op connector"])
        mine = statistics.mean(first["kvbm"]) if short != "throughput" else statistics.mean(tput["kvbm"])
        unit = "tok/s" if short == "throughput" else "ms"
        rows.emit("vllm_cost", f"vLLM no reuse, kvbm vs no-op connector, {n} paired rounds: {short}",
                  f"{mine:.1f} {unit}", f"no-op {base:.1f} {unit}",
                  f"{100 * m:.0f}% (95% interval {100 * lo:.0f}–{100 * hi:.0f}%)", "≥ 95%", v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1K-token documents, fewer requests")
    ap.add_argument("--docs", type=int, default=None, help="distinct documents re-visited (default 6, quick 6)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every column N times (column order rotated) and keep, per column, the run whose "
                         "first visits and no-reuse batches were fastest: on a shared machine interference only "
                         "slows a run down, and those requests have nothing for kvbm to reuse (with --cost: "
                         "N rounds, every one printed)")
    ap.add_argument("--model", choices=("small", "0.5b", "sliding", "state"), default="small",
                    help="small: ~25M parameters (default, minutes on 2 cores); 0.5b: Qwen2-0.5B's dimensions "
                         "(about 20× the prefill work: for a machine with more cores); sliding: small with every "
                         "other layer in a 256-token sliding window (two KV cache groups); state: small as an "
                         "LFM2-like hybrid (short-convolution state layers beside attention)")
    ap.add_argument("--no-peers", action="store_true",
                    help="leave out the peer columns (LMCache, vLLM's OffloadingConnector)")
    ap.add_argument("--cost", action="store_true",
                    help="only kvbm's cost when nothing is reused: first visits and no-reuse throughput of kvbm, "
                         "kvbm with its threads on the model's cores (DYN_KVBM_THREAD_AFFINITY=inherit), kvbm "
                         "with G2 only, the no-op connector, no connector and LMCache (unless --no-peers), their engines side by side and every request sent to "
                         "each in turn; --repeat rounds (default 3), verdicts from the paired ratios' interval")
    ap.add_argument("--lmcache-store-policy", choices=("skip_l1", "default"), default=peers.LMCACHE_STORE_POLICY,
                    help="LMCache's L2 store policy: skip_l1 (every chunk to disk, out of L1; default) or default "
                         "(every chunk to disk and kept in L1 while it fits)")
    ap.add_argument("--lmcache-transfer-mode", choices=("lmcache_driven", "engine_driven"),
                    default=peers.LMCACHE_TRANSFER_MODE,
                    help="how KV moves between vLLM and LMCache's server: engine_driven (the engine's worker "
                         "copies; default, the connector's own choice on CPU) or lmcache_driven (the server, through "
                         "shared memory)")
    a = ap.parse_args()
    peers.LMCACHE_STORE_POLICY = a.lmcache_store_policy
    peers.LMCACHE_TRANSFER_MODE = a.lmcache_transfer_mode
    if a.model == "0.5b":
        model = dict(QWEN2_05B_LIKE, dir="/tmp/kvbm-bench-qwen2-05b-like", dtype="bfloat16")
        mname = "Qwen2-0.5B-like (hidden 896, 24 layers, 14 heads, 2 KV heads)"
    elif a.model == "sliding":
        model = dict(SLIDING, dir="/tmp/kvbm-bench-sliding-small")
        mname = ("~25M-parameter Llama-like with a 256-token sliding window on every other layer "
                 "(hidden 512, 8 layers, 2 KV heads; two KV cache groups)")
    elif a.model == "state":
        model = dict(STATE, dir="/tmp/kvbm-bench-state-small")
        mname = ("~25M-parameter LFM2-like hybrid: short-convolution state layers and full attention in turn "
                 "(hidden 512, 8 layers, 2 KV heads; a state group beside the attention group)")
    else:
        model = dict(SMALL, dir="/tmp/kvbm-demo-model-small")
        mname = "~25M-parameter Qwen2-like (hidden 512, 8 layers, 2 KV heads)"
    if a.quick:
        length, n_unique, unique_len, out_len, docs_n = 1024, 4, 256, 16, 6
    else:
        length, n_unique, unique_len, out_len, docs_n = 2048, 8, 384, 32, 6
    a.docs = a.docs or docs_n
    vocab = model["vocab"]
    doc_blocks = length // compare.BS
    g1 = 2 * (doc_blocks + 1) + 4  # two documents and change: the others are evicted
    host = 2 * doc_blocks  # kvbm's G2: two documents' worth; the enlarged G1 gets the same bytes
    disk = 4 * a.docs * doc_blocks
    if a.docs * doc_blocks <= g1 + host:
        raise SystemExit(f"--docs {a.docs}: {a.docs * doc_blocks} blocks fit in G1 + G2 bytes ({g1 + host})")
    docs = prompts(1, a.docs, length, vocab)
    order = list(range(a.docs))
    random.Random(5).shuffle(order)
    engine = {"max_model_len": length + 64, "max_num_batched_tokens": 2048, "max_num_seqs": 8}
    if "dtype" in model:
        engine["dtype"] = model["dtype"]
    if a.cost:
        if a.repeat == 1 and "--repeat" not in sys.argv:
            a.repeat = 3
        cost(a, model, mname, engine, g1, host, disk, docs, length, n_unique, unique_len, out_len, vocab)
        return
    # The warm-up request is a document's head; with --model state it is a
    # prompt of its own: vLLM resuming a state model from a cached state
    # continues with slightly other floats than computing from scratch (its
    # own prefix cache as well as kvbm's), so a document warmed up would be
    # re-visited from a state the no-kvbm column computed another way.
    warm = prompts(9, 1, 256, vocab)[0] if a.model == "state" else docs[0][:256]
    actions = [
        {"each": [warm], "max_tokens": 1, "tag": "warmup"},
        {"each": docs, "max_tokens": 1, "tag": "first_visit", "progress": True},
        {"each": [docs[i] for i in order], "max_tokens": 1, "check_tokens": CHECK_TOKENS, "tag": "revisit",
         "progress": True},
        {"generate": prompts(3, n_unique, unique_len, vocab), "max_tokens": out_len, "tag": "no_reuse_warmup"},
        {"generate": prompts(2, n_unique, unique_len, vocab), "max_tokens": out_len, "tag": "no_reuse"},
        {"generate": prompts(4, n_unique, unique_len, vocab), "max_tokens": out_len, "tag": "no_reuse_2"},
    ]
    bb = peers.block_bytes(model, engine)
    print(f"vLLM TTFT bench: {mname} model, {a.docs} documents × {length} tokens ({a.docs * doc_blocks} blocks) "
          f"re-visited in shuffled order; G1 {g1} blocks, kvbm G2 {host} blocks + G3 {disk} blocks on disk; "
          f"the enlarged-G1 baseline has {g1 + host} blocks (G1 + G2 bytes); kvbm settings: {compare.KVBM_ENV}",
          flush=True)
    print(compare.engine_threads(), flush=True)
    all_cols = (list(compare.COLUMNS) + ([compare.KVBM_HMA_OFF] if a.model == "sliding" else [])
                + ([] if a.no_peers else list(peers.PEERS)))
    if not a.no_peers:
        print(f"peers, same G1 and the same bytes as kvbm ({bb / 1e3:.0f} kB blocks): LMCache {lmcache_version()} "
              f"(vLLM's LMCacheMPConnector + `lmcache server`, L1 {host * bb / 1e6:.0f} MB LRU, disk "
              f"{disk * bb / 1e6:.0f} MB O_DIRECT LRU, store policy {peers.LMCACHE_STORE_POLICY}, transfers {peers.LMCACHE_TRANSFER_MODE}); vLLM's "
              f"OffloadingConnector with {host * bb / 1e6:.0f} MB of host memory", flush=True)
    tries = []
    for k in range(max(a.repeat, 1)):
        m = k % len(all_cols)
        tries.append(compare.run_columns(model, engine, g1, host, disk, actions,
                                         columns=all_cols[m:] + all_cols[:m]))

    def machine_time(r):
        return sum(r["first_visit"]["secs_each"]) + r["no_reuse"]["secs"] + r["no_reuse_2"]["secs"]

    runs = fastest_runs(tries, all_cols, machine_time)
    failed = {c: runs[c]["error"] for c in all_cols if "error" in runs[c]}
    cols = [c for c in all_cols if c not in failed]

    ref = runs["no kvbm"]["revisit"]["check"]
    same = {c: runs[c]["revisit"]["check"] == ref and runs[c]["revisit"]["tokens"] == runs["no kvbm"]["revisit"]["tokens"]
            for c in cols}
    ntok = n_unique * out_len
    first = {c: statistics.mean(runs[c]["first_visit"]["secs_each"]) for c in cols}
    revisit = {c: statistics.mean(runs[c]["revisit"]["secs_each"]) for c in cols}
    p90 = {c: compare.pct(runs[c]["revisit"]["secs_each"], 0.9) for c in cols}
    tput = {c: max(ntok / runs[c][t]["secs"] for t in ("no_reuse", "no_reuse_2")) for c in cols}
    split = {c: compare.tier_split([runs[c]["revisit"]],
                                   runs[c]["first_visit"].get("metrics") if c.startswith("kvbm") else None,
                                   peer=c if c in peers.PEERS else None) for c in cols}
    first_tokens = sum(len(d) for d in docs)
    stored = {c: compare.stored_bytes_per_token(runs[c]["first_visit"], first_tokens) if c.startswith("kvbm")
              else None for c in cols}
    block_bytes = runs["kvbm"]["revisit"].get("metrics", {}).get("kvbm_block_bytes")
    if block_bytes and int(block_bytes) != bb:
        print(f"NOTE: kvbm's block is {block_bytes:.0f} bytes, the peers were sized with {bb}")

    ms = lambda v: f"{v * 1000:.0f} ms"  # noqa: E731
    print()
    compare.print_table([
        ("engine started", {c: failed.get(c, "yes") for c in all_cols}, str),
        (f"first visit, TTFT mean ({a.docs} × {length} tokens)", first, ms),
        ("re-visit, TTFT mean", revisit, ms),
        ("re-visit, TTFT p90", p90, ms),
        ("re-visit, prompt tokens served by", split, compare.fmt_split),
        (f"re-visit, {CHECK_TOKENS} output tokens identical to no kvbm", same, lambda v: "yes" if v else "NO"),
        (f"no reuse ({n_unique} × {unique_len} prompt + {out_len} out), tok/s", tput, lambda v: f"{v:.1f}"),
    ] + ([("first visits, bytes kvbm stored per prompt token", stored,
           lambda v: "-" if v is None else f"{v / 1e3:.1f} kB")] if compare.KVBM_HMA_OFF in cols else []), all_cols)
    best = compare.strongest(revisit)
    speed = revisit[best] / revisit["kvbm"]
    best_t = compare.strongest(tput, lower_is_better=False)
    frac = tput["kvbm"] / tput[best_t]
    print()
    print(f"headline: re-visit TTFT {faster(speed)} with kvbm than the strongest other column ({best}, "
          f"{revisit[best] * 1000:.0f} ms); no-reuse throughput {100 * frac:.0f}% of the strongest ({best_t})")
    for c in all_cols:
        if c in peers.PEERS:
            if c in failed:
                print(f"kvbm against {c}: not measured, {c} did not run: {failed[c]}")
            else:
                print(f"kvbm against {c}: re-visit TTFT {faster(revisit[c] / revisit['kvbm'])}, first-visit TTFT "
                      f"{faster(first[c] / first['kvbm'])}, no-reuse throughput {100 * tput['kvbm'] / tput[c]:.0f}%")
    print(f"equal memory: kvbm's G2 is {host} blocks"
          + (f" × {block_bytes / 1e3:.0f} kB = {host * block_bytes / 1e6:.0f} MB" if block_bytes else "")
          + f"; the enlarged-G1 baseline has exactly {host} more vLLM blocks of the same size; the peers get the "
          f"same host bytes and kvbm's G3 bytes ({disk} blocks) on disk.")
    others = ", ".join(f"{c} {revisit[c] * 1000:.0f} ms" for c in cols if c not in (best, "kvbm"))
    rows.emit("vllm_ttft", f"vLLM TTFT, {a.docs} × {length}-token documents re-visited (> G1 + G2 bytes), {mname}",
              ms(revisit["kvbm"]), f"strongest: {best} {ms(revisit[best])} ({others})", faster(speed),
              "≥ 3× faster than the strongest", speed >= 3)
    fbest = compare.strongest(first)
    rows.emit("vllm_ttft", f"vLLM TTFT, first visit (nothing to reuse; kvbm writes every block through)",
              ms(first["kvbm"]), f"strongest: {fbest} {ms(first[fbest])}"
              + ("" if fbest == "no-op connector" else f"; no-op connector {ms(first['no-op connector'])}"),
              f"{faster(first[fbest] / first['kvbm'])} ({100 * first['kvbm'] / first['no-op connector']:.0f}% of no-op's time)",
              "")
    rows.emit("vllm_ttft", "vLLM re-visit tokens served (kvbm run)", compare.fmt_split(split["kvbm"]),
              f"{best}: {compare.fmt_split(split[best])}", "", "")
    for c in peers.PEERS:
        if c in failed:
            rows.emit("vllm_ttft", f"vLLM re-visit TTFT against {c}", ms(revisit["kvbm"]), f"{c} did not run: "
                      + failed[c][:160], "", "")
        elif c in cols:
            r = revisit[c] / revisit["kvbm"]
            rows.emit("vllm_ttft", f"vLLM re-visit TTFT against {c} (same bytes)", ms(revisit["kvbm"]),
                      f"{c} {ms(revisit[c])}", faster(r), "≥ 1.2× faster", r >= 1.2)
    noop = tput["kvbm"] / tput["no-op connector"]
    print(f"no reuse: kvbm {100 * noop:.0f}% of the no-op connector's throughput (kvbm's own write-through cost; "
          f"the rest of the gap to {best_t} is that column's own path)")
    rows.emit("vllm_ttft", f"vLLM throughput, no reuse ({n_unique} × {unique_len} + {out_len} out)",
              f"{tput['kvbm']:.1f} tok/s", f"strongest: {best_t} {tput[best_t]:.1f} tok/s"
              + ("" if best_t == "no-op connector" else f"; no-op connector {tput['no-op connector']:.1f} tok/s"),
              f"{100 * frac:.0f}% of strongest, {100 * noop:.0f}% of no-op", "≥ 95% of the no-op connector",
              noop >= 0.95)
    if not all(same.values()):
        raise SystemExit("outputs differ across the columns: " + ", ".join(c for c in cols if not same[c]))


def lmcache_version():
    """LMCache's version in its environment, or why there is none."""
    import subprocess

    py = peers.lmcache_python(ROOT)
    if py is None:
        return "(no environment: scripts/lmcache-env.sh)"
    try:
        out = subprocess.run([py, "-c", "from importlib.metadata import version; print(version('lmcache'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "(version unknown)"
    except (OSError, subprocess.SubprocessError) as e:
        return f"(version unknown: {e})"


if __name__ == "__main__":
    main()
