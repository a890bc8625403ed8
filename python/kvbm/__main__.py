"""``python -m kvbm purge|stats``: operator calls to a running engine (kvbm.admin)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from kvbm import admin


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbm", description=__doc__)
    ap.add_argument("--pid", type=int, help="the engine's process id (when several run)")
    ap.add_argument("--socket", help="the engine's socket path")
    ap.add_argument("--dir", help="where engines put their sockets (default: DYN_KVBM_ADMIN_DIR, "
                    "$XDG_RUNTIME_DIR/kvbm, /tmp/kvbm-<uid>)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("purge", help="forget a salt's, a prefix's or all KV in every tier")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--salt", help="the cache_salt of the tenant to forget")
    g.add_argument("--prefix-tokens", help="comma-separated token ids of a prompt prefix")
    g.add_argument("--all", action="store_true", help="everything, G4 objects of every model included")
    p.add_argument("--prefix-salt", help="with --prefix-tokens: the cache_salt its requests carried")
    p.add_argument("--lora", action="append", help="LoRA adapter name the salt (or prefix) was used with; repeatable")
    sub.add_parser("stats", help="tier occupancy, hit rates, purge and expiry counters")
    a = ap.parse_args(argv)
    where = dict(pid=a.pid, socket=a.socket, directory=a.dir)
    try:
        if a.cmd == "stats":
            out = admin.stats(**where)
        else:
            toks = None
            if a.prefix_tokens is not None:
                try:
                    toks = [int(t) for t in a.prefix_tokens.replace(" ", "").split(",") if t]
                except ValueError:
                    ap.error("--prefix-tokens: comma-separated integers")
            salt = a.salt if a.prefix_tokens is None else a.prefix_salt
            out = admin.purge(salt=salt, lora=a.lora, prefix_tokens=toks, all=a.all, **where)
    except admin.AdminError as e:
        print(f"kvbm: {e}", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
