"""The closing table of `make bench`: every bench's summary rows (figure, kvbm,
baseline(s) named, ratio, target), read from the JSON-lines file the benches
appended to, and one line about the machine they ran on.

    python bench/summary.py DIR      # DIR/rows.jsonl, i.e. $KVBM_BENCH_OUT
"""

from __future__ import annotations

import json
import os
import sys


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == "model name":
                    return v.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def filesystem(path: str) -> str:
    """The filesystem type and source of path, from /proc/self/mounts (longest mount point)."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                src, mnt, typ = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, typ, src)
    except OSError:
        pass
    return f"{best[1]} on {best[2]} mounted at {best[0]} ({path})"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = os.path.join(argv[0], "rows.jsonl")
    rows, machine = [], {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    obj = json.loads(line)
                except ValueError:
                    print(f"{path}:{n}: not JSON, skipped", file=sys.stderr)
                    continue
                if "machine" in obj:
                    machine.update(obj["machine"])
                else:
                    rows.append(obj)
    except FileNotFoundError:
        print(f"no summary rows: {path} does not exist", file=sys.stderr)
        return 1
    cols = ("bench", "figure", "kvbm", "baseline(s), same run", "ratio", "target", "met")

    def met(r):
        return {True: "yes", False: "NO", None: "–"}[r.get("ok")]

    table = [[r.get("bench", ""), r.get("figure", ""), r.get("kvbm", ""), r.get("baseline", ""), r.get("ratio", ""),
              r.get("target", ""), met(r)] for r in rows]
    print()
    print("== summary (every figure against its baseline, measured in the same run)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for t in table:
        print("| " + " | ".join(c.replace("|", "/") for c in t) + " |")
    fs = machine.get("bench_dir_fs") or filesystem(os.environ.get("TMPDIR", "/var/tmp"))
    od = machine.get("o_direct")
    odt = "not measured" if od is None else ("yes" if od else f"NO ({machine.get('o_direct_note') or 'fell back'})")
    print()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, bench dir {fs}, O_DIRECT {odt}")
    missed = [r["figure"] for r in rows if r.get("ok") is False]
    if missed:
        print(f"targets missed: {len(missed)} of {sum(r.get('ok') is not None for r in rows)}: " + "; ".join(missed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
