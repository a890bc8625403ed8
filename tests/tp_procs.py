"""Shared by the tensor-parallel process tests (CPU and GPU): the leader
process gathering one message of a kind from every worker process."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable


def collect(from_workers: Any, kind: str, world: int, timeout: float,
            dead_ranks: Callable[[], list[int]]) -> dict[int, tuple]:
    """One ``(kind, rank, ...)`` message from each of ``world`` ranks, by rank.

    The executor waits for every worker's output; a worker that died shows up
    as a dead rank on the side channel instead of a hang."""
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world:
        try:
            msg = from_workers.get(timeout=0.2)
        except queue.Empty:
            dead = dead_ranks()
            if dead:
                raise RuntimeError(f"worker rank(s) {dead} died waiting for {kind!r}") from None
            if time.monotonic() > deadline:
                raise
            continue
        assert msg[0] == kind, msg
        got[msg[1]] = msg
    return got


def dead_ranks(leader: Any) -> list[int]:
    """The side channel's dead ranks of a ready leader ([] before it is ready)."""
    if leader is None:
        return []
    sc = leader.info().get("side_channel")
    return list(sc["dead_ranks"]) if sc else []


def wait_for(get: Callable[[], Any], cond: Callable[[Any], bool], timeout: float) -> Any:
    """``get()`` once ``cond`` holds for it, or its last value after ``timeout``
    seconds (the caller's assertion then shows what it was)."""
    deadline = time.monotonic() + timeout
    while True:
        v = get()
        if cond(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.02)
