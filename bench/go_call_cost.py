"""What one call into kvbm's Go library costs from Python, back to back and
after other work (as an engine's calls come, once the forward pass has left
the caches cold), against a libc call in the same places.

    python bench/go_call_cost.py [--n 500 | --quick] [--gap-ms 5]

Prints the median and p90 of: getpid (libc, the baseline), a trivial export
(kvbm_is_poisoned), kvbm_leader_step with four decode rows after the gap, and
the same step again right after it. KVBM_LIBRARY selects another build of
the library (to compare two).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
os.environ.setdefault("DYN_KVBM_CPU_CACHE_GB", "0.01")

from kvbm import _native  # noqa: E402
from kvbm._core import Leader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="100 calls each")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="other work (Python) before each measured call")
    a = ap.parse_args()
    if a.quick:
        a.n = 100
    leader = Leader(block_size=16, bytes_per_block=1024)
    lib, libc = _native.lib(), ctypes.CDLL(None)
    leader.step([[f"r{i}", list(range(256)), list(range(i * 17, i * 17 + 17)), 0, 256, None, 0, False]
                 for i in range(4)], [], [])
    times: dict[str, list[float]] = {k: [] for k in (
        "getpid (libc), after the gap", "kvbm_is_poisoned, after the gap", "kvbm_leader_step, 4 decode rows, after the gap",
        "kvbm_leader_step, 4 decode rows, right after", "getpid (libc), back to back", "kvbm_is_poisoned, back to back")}
    keys = list(times)

    def work() -> None:
        end = time.perf_counter() + a.gap_ms / 1000
        x = 0
        while time.perf_counter() < end:
            x += sum(range(1000))

    for k in range(a.n):
        rows = [[f"r{i}", [k], [], 256 + k, 1, None, 0, False] for i in range(4)]
        for key, call in ((keys[0], libc.getpid), (keys[1], lib.kvbm_is_poisoned),
                          (keys[2], lambda: leader.step(rows, [], []))):
            work()
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
        t = time.perf_counter()
        leader.step([], [], [])
        times[keys[3]].append(time.perf_counter() - t)
        for key, call in ((keys[4], libc.getpid), (keys[5], lib.kvbm_is_poisoned)):
            call()
            t = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t)
    leader.close()
    print(f"calls from Python, {a.n} each, {a.gap_ms:g} ms of other work before each 'after the gap' call "
          f"(library {_native.loaded_path()})")
    print(f"{'call':50} {'median µs':>10} {'p90 µs':>8}")
    for key, v in times.items():
        v.sort()
        print(f"{key:50} {v[len(v) // 2] * 1e6:10.1f} {v[int(len(v) * 0.9)] * 1e6:8.1f}")


if __name__ == "__main__":
    main()
