"""Summary rows of the Python benches, appended to $KVBM_BENCH_OUT/rows.jsonl
(the file bench/summary.py prints as the closing table of `make bench`);
without KVBM_BENCH_OUT nothing is written. Same fields as bench/internal/rows."""

from __future__ import annotations

import json
import os
import sys


def _write(obj) -> None:
    d = os.environ.get("KVBM_BENCH_OUT")
    if not d:
        return
    try:
        with open(os.path.join(d, "rows.jsonl"), "a") as f:
            f.write(json.dumps(obj) + "\n")
    except OSError as e:  # the bench's own table is already printed
        print(f"bench rows (KVBM_BENCH_OUT): {e}", file=sys.stderr)


def emit(bench: str, figure: str, kvbm: str, baseline: str, ratio: str, target: str = "", ok: bool | None = None):
    _write({"bench": bench, "figure": figure, "kvbm": kvbm, "baseline": baseline, "ratio": ratio,
            "target": target, "ok": ok})


def emit_machine(**facts) -> None:
    _write({"machine": facts})
