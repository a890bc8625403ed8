"""kvbm's main job, end to end: vLLM (CPU backend) serving multi-turn chat
traffic with kvbm and without it, same prompts, every column's engine
running side by side and each request sent to every engine in turn:

* no kvbm (G1 of --g1-blocks);
* no kvbm with G1 enlarged by exactly kvbm's G2 bytes (on the CPU backend G1
  is host memory too: "give vLLM the memory instead");
* a no-op KV connector (vLLM's connector code path without kvbm);
* kvbm: the same G1, --host-blocks of host memory (G2), --disk-blocks on disk (G3).

    python -m kvbm.demo [--conversations 10] [--turns 4] [--chart PATH]

The traffic: every conversation starts with the same system prompt; each turn
appends a user message (or a tool's output) to the conversation's history,
and the model's reply after it; the conversations take turns, so by the time one comes back its
history has been evicted from G1 by the others. Their histories together
outgrow G1 plus the memory kvbm gets, so the enlarged G1 cannot hold them
either; kvbm keeps what leaves host memory on disk.

The model is generated locally with random weights (no model hub needed);
greedy decoding, so every column must produce the same replies. The table
gives TTFT per column, where the prompt tokens came from (G1, kvbm's G2 or G3,
or recomputed), and kvbm against the strongest baseline; a PNG chart of TTFT
per request is written and its path printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

MODELS: dict[str, dict[str, Any] | None] = {
    # ~25M parameters: quick on two CPU cores.
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8000, arch="qwen2"),
    "0.5b": None,  # filled from QWEN2_05B_LIKE
}


def chart(path: str, runs: dict, turns_at: list[int], title: str) -> str | None:
    """TTFT per request, one line per column; returns the path, or None
    (with the reason printed) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
        return None
    styles = {"no kvbm": ("tab:red", "-"), "no kvbm, G1 + G2 bytes": ("tab:orange", "--"),
              "no-op connector": ("tab:gray", ":"), "kvbm": ("tab:green", "-"),
              "LMCache": ("tab:blue", "-."), "vLLM OffloadingConnector": ("tab:purple", "-.")}
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    for col, r in runs.items():
        ys = [t * 1000 for t in r["ttft_each"]]
        color, ls = styles.get(col, (None, "-"))
        ax.plot(range(1, len(ys) + 1), ys, ls, color=color, marker="o", markersize=3,
                linewidth=2.2 if col == "kvbm" else 1.4, label=f"{col} (mean {statistics.mean(ys):.0f} ms)")
    for x in turns_at[1:]:
        ax.axvline(x - 0.5, color="0.85", linewidth=0.8, zorder=0)
    ax.set_xlabel("request (conversations interleaved; grey lines: next turn)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return os.path.abspath(path)


def converse(live: dict, columns: list[str], chat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Multi-turn chat on every column's engine, paired: each request goes to
    every engine in turn (the order rotated per request), one engine working
    at a time, so a request and its pairs in the other columns run seconds
    apart on the same machine. Every conversation shares a system prefix; each
    turn appends a user message and the column's own reply to its history.
    The conversations take turns, so their KV competes for G1. TTFT is the
    wall time of a max_tokens=1 request for the turn's prompt; the reply is
    then generated from the same prompt (a G1 prefix hit). After a request a
    kvbm column waits until its background work (G2→G3 moves) is done, so
    none of it runs during another column's request. Returns per column
    {"ttft_each", "prompt_lens", "tokens" (replies), "num_cached_tokens",
    "metrics" (kvbm's, at the end), and for kvbm "ttft_onboard": its onboard
    counters' growth over the TTFT requests alone}."""
    onboard = ("kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d")
    # kvbm's loads during the TTFT requests only (a reply's prompt, a G1 hit,
    # may load its last block too): its counters before and after each one.
    prev = {c: live[c].do({"quiesce": True, "tag": "quiesce"}).get("metrics") or {}
            for c in columns if live[c].spec.get("kvbm")}
    rng = random.Random(chat.get("seed", 0))
    vocab = chat["vocab"]
    prefix = [rng.randrange(3, vocab - 1) for _ in range(chat["prefix_len"])]
    n, turns = chat["conversations"], chat["turns"]
    history: dict[str, list[list[int]]] = {c: [[] for _ in range(n)] for c in columns}
    out: dict[str, dict[str, Any]] = {
        c: {"ttft_each": [], "prompt_lens": [], "tokens": [], "num_cached_tokens": [], "metrics": {}}
        for c in columns}
    for c in prev:
        out[c]["ttft_onboard"] = dict.fromkeys(onboard, 0)
    for t in range(turns):
        for i in range(n):
            k = t * n + i
            user = [rng.randrange(3, vocab - 1) for _ in range(chat["user_len"])]
            m = k % len(columns)
            for c in columns[m:] + columns[:m]:
                p = prefix + history[c][i] + user
                first = live[c].do({"each": [p], "max_tokens": 1, "tag": "ttft"})
                reply = live[c].do({"generate": [p], "max_tokens": chat["reply_len"], "tag": "reply"})
                last = live[c].do({"quiesce": True, "tag": "quiesce"}) if live[c].spec.get("kvbm") else reply
                toks = reply["tokens"][0]
                history[c][i] += user + toks
                o = out[c]
                o["ttft_each"].append(first["secs_each"][0])
                o["prompt_lens"].append(len(p))
                o["tokens"].append(toks)
                o["num_cached_tokens"].append(first["num_cached_tokens"][0])
                o["metrics"] = last.get("metrics") or {}
                if c in prev:
                    after = first.get("metrics") or {}
                    for name in onboard:
                        o["ttft_onboard"][name] += after.get(name, 0) - prev[c].get(name, 0)
                    prev[c] = o["metrics"]
            print(f"[chat] request {k + 1}/{n * turns}: conversation {i + 1} turn {t + 1}, "
                  f"{len(prefix) + len(history[columns[0]][i])} tokens after the reply; TTFT " +
                  ", ".join(f"{c} {1000 * out[c]['ttft_each'][-1]:.0f} ms" for c in columns), flush=True)
    return out


def report(chats: dict[str, dict[str, Any]], columns: list[str], asked: list[str], failed: dict[str, str],
           conversations: int, reply_len: int, peers_shown: bool = False) -> dict[str, bool]:
    """Prints the demo's table and its paired figures from converse's
    results (per column) and returns, per column, whether its replies match the
    reference column's (no kvbm, or the first column that is not kvbm).
    The figures for turns 2 on are left out when the chat had one turn."""
    from kvbm.testing import compare, peers

    ref = "no kvbm" if "no kvbm" in columns else next(c for c in columns if c != "kvbm")
    same = {c: chats[c]["tokens"] == chats[ref]["tokens"] for c in columns}
    ttft = {c: chats[c]["ttft_each"] for c in columns}
    turns = len(ttft["kvbm"]) // conversations
    first = {c: ttft[c][:conversations] for c in columns}  # turn 1: nothing to reuse but the system prompt
    later = {c: ttft[c][conversations:] for c in columns}  # turns 2..
    split = {c: compare.tier_split([dict(chats[c], metrics=chats[c]["ttft_onboard"])], {})
             if "ttft_onboard" in chats[c] else compare.tier_split([chats[c]], None, peer=c if c in peers.PEERS else None)
             for c in columns}
    ms = lambda v: f"{v * 1000:.0f} ms"  # noqa: E731
    print()
    compare.print_table(([("engine started", {c: failed.get(c, "yes") for c in asked}, str)] if peers_shown else []) + [
        ("requests", {c: len(ttft[c]) for c in columns}, str),
        ("TTFT mean", {c: statistics.mean(ttft[c]) for c in columns}, ms),
        ("TTFT p50", {c: compare.pct(ttft[c], 0.5) for c in columns}, ms),
        ("TTFT p90", {c: compare.pct(ttft[c], 0.9) for c in columns}, ms),
        ("TTFT mean, turn 1", {c: statistics.mean(first[c]) for c in columns}, ms),
    ] + ([(f"TTFT mean, turns 2–{turns}", {c: statistics.mean(later[c]) for c in columns}, ms)] if turns > 1 else []) + [
        ("prompt tokens served by", split, compare.fmt_split),
        (f"replies ({reply_len} tokens) identical to {ref}", same, lambda v: "yes" if v else "NO"),
    ], asked)
    means = {c: statistics.mean(ttft[c]) for c in columns}
    best = compare.strongest(means)

    def vs(b: float, k: float) -> str:
        r = b / k
        return f"{r:.2f}× faster" if r >= 1 else f"{1 / r:.2f}× slower"

    def paired(base: list[float], mine: list[float]) -> str:
        """kvbm's speed against base over the paired requests: geometric
        mean and 95% bootstrap interval."""
        m, lo, hi = compare.paired_ratio([b / k for b, k in zip(base, mine)])
        return f"{m:.2f}× per request, 95% interval {lo:.2f}–{hi:.2f}×"

    line = (f"\nkvbm against the strongest other column: TTFT mean {vs(means[best], means['kvbm'])} ({best}; "
            f"{paired(ttft[best], ttft['kvbm'])})")
    if turns > 1:
        lbest = compare.strongest({c: statistics.mean(later[c]) for c in columns})
        line += (f"; turns 2–{turns}, where there is history to reuse: "
                 f"{vs(statistics.mean(later[lbest]), statistics.mean(later['kvbm']))} ({lbest}; "
                 f"{paired(later[lbest], later['kvbm'])})")
    print(line + ".")
    if "no-op connector" in columns:
        # Turn 1 reuses nothing but the system prompt, which stays in G1: what kvbm's write-through costs.
        m, lo, hi = compare.paired_ratio([b / k for b, k in zip(first["no-op connector"], first["kvbm"])])
        word = {True: "met", False: "NOT met", None: "not decided: the interval spans 95%"}[
            compare.verdict(lo, hi, 0.95)]
        print(f"Turn 1 (nothing to reuse but the system prompt): kvbm at {100 * m:.1f}% of the no-op connector's "
              f"speed (geometric mean of {len(first['kvbm'])} paired requests, 95% interval "
              f"{100 * lo:.1f}–{100 * hi:.1f}%; target ≥ 95%: {word}).")
    if compare.ENLARGED in columns:
        print("The enlarged-G1 column has kvbm's host memory given to vLLM; what it cannot hold, kvbm keeps on disk.")
    return same


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512, help="shared system prompt, tokens")
    ap.add_argument("--user-len", type=int, default=128,
                    help="tokens per user message (or tool output, in agentic traffic)")
    ap.add_argument("--reply-len", type=int, default=16, help="tokens per reply (compared across columns)")
    ap.add_argument("--g1-blocks", type=int, default=48, help="vLLM's own KV cache, in 32-token blocks")
    ap.add_argument("--host-blocks", type=int, default=64, help="kvbm G2 (host memory) blocks")
    ap.add_argument("--disk-blocks", type=int, default=1024, help="kvbm G3 (disk) blocks")
    ap.add_argument("--skip-noop", action="store_true", help="leave out the no-op connector column")
    ap.add_argument("--columns", default="",
                    help="comma-separated columns to run (kvbm and at least one other; default all): e.g. "
                         "'no-op connector,kvbm' with --turns 1 --conversations 100 measures turn 1's cost with "
                         "two engines sharing the machine instead of four")
    ap.add_argument("--peers", action="store_true",
                    help="add the peer columns: LMCache (from .venv-lmcache, scripts/lmcache-env.sh) and vLLM's "
                         "OffloadingConnector, with kvbm's G2 and G3 bytes; a peer that cannot run says why")
    ap.add_argument("--chart", default=os.path.join(tempfile.gettempdir(), "kvbm-demo", "ttft-per-request.png"),
                    help="where the PNG chart goes")
    a = ap.parse_args(argv)

    from kvbm.testing import compare, peers
    from kvbm.testing.tiny_model import QWEN2_05B_LIKE

    model = dict(QWEN2_05B_LIKE) if a.model == "0.5b" else dict(MODELS[a.model] or {})
    model["dir"] = f"/tmp/kvbm-demo-model-{a.model}"
    bs = compare.BS
    chat = {"conversations": a.conversations, "turns": a.turns, "prefix_len": a.system_len, "user_len": a.user_len,
            "reply_len": a.reply_len, "vocab": model["vocab"], "tag": "chat"}
    max_len = a.system_len + a.turns * (a.user_len + a.reply_len) + 32
    history_blocks = a.conversations * (a.turns - 1) * (a.user_len + a.reply_len) // bs
    need = a.system_len // bs + history_blocks
    engine = {"max_model_len": min(max_len, (a.g1_blocks - 1) * bs), "max_num_batched_tokens": 1024}
    if a.model == "0.5b":
        engine["dtype"] = model["dtype"] = "bfloat16"
    asked = pick_columns(a.columns, a.skip_noop, a.peers)
    print(f"kvbm demo: {a.conversations} chat conversations × {a.turns} turns, interleaved; shared system prompt "
          f"{a.system_len} tokens, user messages {a.user_len}, replies {a.reply_len} tokens. Their KV by the last "
          f"turn: ~{need} blocks of {bs} tokens; vLLM's G1 {a.g1_blocks} blocks; kvbm G2 {a.host_blocks} blocks "
          f"(the enlarged G1 gets the same bytes: {a.g1_blocks + a.host_blocks} blocks), G3 {a.disk_blocks} blocks "
          f"on disk", flush=True)
    print(compare.engine_threads(), flush=True)
    warm = {"each": [[5 + (i % 200) for i in range(96)]], "max_tokens": 1, "tag": "warmup"}
    live, failed = compare.start_columns(asked, model, engine, a.g1_blocks, a.host_blocks, a.disk_blocks,
                                         kv_env={"DYN_KVBM_CACHE_STATS_LOG_INTERVAL_SECS": 60})
    columns = [c for c in asked if c in live]
    try:
        for c in columns:
            live[c].do(warm)
        chats = converse(live, columns, chat)
    finally:
        for col in live.values():
            col.close()
    same = report(chats, columns, asked, failed, a.conversations, a.reply_len,
                  peers_shown=any(c in peers.PEERS for c in asked))
    ttft = {c: chats[c]["ttft_each"] for c in columns}
    path = chart(a.chart, chats, list(range(1, len(ttft["kvbm"]) + 1, a.conversations)),
                 f"vLLM CPU backend, {a.model} model: {a.conversations} conversations × {a.turns} turns, "
                 f"G1 {a.g1_blocks} blocks, kvbm G2 {a.host_blocks} + G3 {a.disk_blocks} blocks")
    if path:
        print(f"chart: {path}")
    if not all(same.values()):
        raise SystemExit("replies differ across the columns: " + ", ".join(c for c in columns if not same[c]))


def pick_columns(spec: str, skip_noop: bool = False, with_peers: bool = False) -> list[str]:
    """The columns to run, in the table's order: every baseline and kvbm
    (less the no-op connector with skip_noop; plus the peers with
    with_peers), or those named in spec (comma-separated), which must be
    known and include kvbm and one other."""
    from kvbm.testing import compare, peers

    known = list(compare.COLUMNS) + list(peers.PEERS)
    if not spec:
        return [c for c in compare.COLUMNS if not (skip_noop and c == "no-op connector")] + (
            list(peers.PEERS) if with_peers else [])
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"kvbm demo: --columns: unknown column(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(known)}")
    if "kvbm" not in names or len(set(names)) < 2:
        raise SystemExit("kvbm demo: --columns must name kvbm and at least one other column")
    return [c for c in known if c in names]


if __name__ == "__main__":
    main()
