"""Keep kvbm's Go threads off the cores an engine binds its model to.

vLLM's CPU backend binds the model's OpenMP threads to a set of cores
(``OMP_PLACES`` with ``OMP_PROC_BIND=true``, or ``GOMP_CPU_AFFINITY``) and
keeps the remaining ones ("reserved", ``VLLM_CPU_NUM_OF_RESERVED_CPU``) for
its scheduler and the KV connector. The worker's main thread is one of the
OpenMP threads, so it is bound to a model core; a library loaded from it
would start its threads there, inheriting that mask: kvbm's Go runtime would
run every copy, checksum and disk write on the model's core, with GOMAXPROCS
1, while the reserved core stays idle.

:func:`runtime_cores` says which cores kvbm's threads should use: the
process's cores (its parent's affinity and the calling thread's) less the
model's. :func:`on_cores` runs a block on them: the Go runtime started
inside it (the library's load) creates its threads there, and every later Go
thread descends from those, so the whole runtime stays there and GOMAXPROCS
counts only those cores. Without an engine binding, nothing changes.

``DYN_KVBM_THREAD_AFFINITY``: ``auto`` (default, the above) or ``inherit``
(kvbm's threads keep the loading thread's cores).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_PLACE = re.compile(r"\{([^{}]*)\}")


def _parse_place(body: str) -> set[int] | None:
    """One OpenMP place: "0,1,2", "0:4" (start:length) or "0:4:2"."""
    out: set[int] = set()
    for part in body.split(","):
        part = part.strip()
        if not part:
            return None
        nums = part.split(":")
        if not all(n.strip().isdigit() for n in nums):
            return None
        vals = [int(n) for n in nums]
        if len(vals) == 1:
            out.add(vals[0])
        elif len(vals) in (2, 3):
            start, length = vals[0], vals[1]
            stride = vals[2] if len(vals) == 3 else 1
            if length > 4096 or stride == 0:
                return None
            out.update(start + i * stride for i in range(length))
        else:
            return None
    return out


def engine_cores(env: Mapping[str, str]) -> set[int] | None:
    """The cores an engine bound its OpenMP threads to, from the variables
    vLLM's CPU backend sets; None when it bound none (or a form not
    understood here)."""
    places = env.get("OMP_PLACES", "").strip()
    if places and env.get("OMP_PROC_BIND", "").strip().lower() in ("true", "close", "spread", "master", "primary"):
        found = _PLACE.findall(places)
        if not found or _PLACE.sub("", places).replace(",", "").strip():
            return None
        cores: set[int] = set()
        for body in found:
            p = _parse_place(body)
            if p is None:
                return None
            cores |= p
        return cores or None
    gomp = env.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:
        cores = set()
        for tok in gomp.replace(",", " ").split():
            a, _, b = tok.partition("-")
            if not a.isdigit() or (b and not b.isdigit()):
                return None
            lo, hi = int(a), int(b or a)
            if hi < lo or hi - lo > 4096:
                return None
            cores.update(range(lo, hi + 1))
        return cores or None
    return None


def process_cores() -> set[int]:
    """The cores this process may use: the calling thread's and its
    parent's (the engine's worker inherits its parent's full mask before
    binding its own main thread)."""
    cores = set(os.sched_getaffinity(0))
    try:
        cores |= set(os.sched_getaffinity(os.getppid()))
    except OSError:
        pass
    return cores


AFFINITY_MODES = ("auto", "inherit")


def affinity_mode(env: Mapping[str, str]) -> str:
    """DYN_KVBM_THREAD_AFFINITY: auto (default) or inherit."""
    raw = env.get("DYN_KVBM_THREAD_AFFINITY", "")
    mode = raw.strip().lower() or AFFINITY_MODES[0]
    if mode not in AFFINITY_MODES:
        raise ValueError(f"invalid DYN_KVBM_THREAD_AFFINITY={raw!r}: must be one of {', '.join(AFFINITY_MODES)}")
    return mode


def runtime_cores(env: Mapping[str, str] | None = None, available: set[int] | None = None) -> set[int] | None:
    """The cores for kvbm's threads: available (default process_cores())
    less the engine's model cores; None when the engine bound none, left
    no other core, or DYN_KVBM_THREAD_AFFINITY is inherit."""
    env = os.environ if env is None else env
    if affinity_mode(env) == "inherit":
        return None
    model = engine_cores(env)
    if model is None:
        return None
    rest = (process_cores() if available is None else available) - model
    return rest or None


@contextmanager
def on_cores(cores: set[int] | None) -> Iterator[None]:
    """Run the block with the calling thread on cores (threads it creates
    inherit them), then put its own mask back; None: unchanged."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
