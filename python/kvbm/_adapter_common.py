"""Pieces shared by the engine adapters (vLLM, TensorRT-LLM).

Both adapters follow one rule: an engine-facing method never raises into the
engine at run time. A kvbm failure (including a Go panic, which poisons the
library) disables kvbm for the process with one error log, and the engine
keeps serving by recomputing. Configuration errors are different: they are
raised from the connector constructors so that a bad setting fails start-up
with a message naming it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Concatenate, NamedTuple, ParamSpec, Protocol, TypedDict, TypeVar, overload

from kvbm import _plan


class StepUpdate(NamedTuple):
    """One request's row in a step (:meth:`kvbm._core.Leader.step`). A tuple,
    so msgpack encodes it as the same 10-element array as a plain list."""

    req_id: str
    new_tokens: list[int]  # tokens not sent before (all of them when resumed, but known_tokens)
    new_block_ids: list[int]  # G1 blocks added since the last step
    num_computed: int  # tokens whose KV is in G1 before this step
    num_scheduled: int  # tokens computed in this step
    # None: no priorities (the offload filter does not apply); a list: the
    # priority of each new block; an int: one priority for all of them.
    priority: list[int] | int | None
    salt: int  # the request's salt hash (_native.salt_hash)
    resumed: bool  # token and block lists start over (preempted, replayed)
    # new_tokens follow the first known_tokens tokens the leader got at
    # matching (each token crosses the C ABI once); 0: they are all of them.
    known_tokens: int = 0
    # KV cache groups (a leader with kv_groups): (replace, every group's new
    # block ids); None when the row adds none.
    groups: tuple[bool, list[list[int]]] | None = None


class Guardable(Protocol):
    """What :func:`guarded` needs of the object whose methods it wraps."""

    @property
    def _failed(self) -> str | None: ...

    def _fail(self, where: str, err: Exception) -> None: ...


_S = TypeVar("_S", bound=Guardable)
_A = ParamSpec("_A")
_R = TypeVar("_R")
_D = TypeVar("_D")


# A guarded method returns what it returns or, after a failure, the default.
@overload
def guarded() -> Callable[[Callable[Concatenate[_S, _A], _R]], Callable[Concatenate[_S, _A], _R | None]]: ...


@overload
def guarded(
    default: Callable[[Any], _D],
) -> Callable[[Callable[Concatenate[_S, _A], _R]], Callable[Concatenate[_S, _A], _R | _D]]: ...


@overload
def guarded(
    default: _D,
) -> Callable[[Callable[Concatenate[_S, _A], _R]], Callable[Concatenate[_S, _A], _R | _D]]: ...


def guarded(default: Any = None) -> Callable[[Callable[Concatenate[_S, _A], _R]], Callable[Concatenate[_S, _A], Any]]:
    """Decorator for engine-facing methods of an object with ``_failed``
    (None while healthy) and ``_fail(where, err)``.

    ``default`` is returned when the object has failed or the call raises; a
    callable default is called with the object (for fresh mutable values).
    """

    def fallback(obj: _S) -> Any:
        return default(obj) if callable(default) else default

    def deco(fn: Callable[Concatenate[_S, _A], _R]) -> Callable[Concatenate[_S, _A], Any]:
        @functools.wraps(fn)
        def wrapper(self: _S, *args: _A.args, **kwargs: _A.kwargs) -> Any:
            if self._failed is not None:
                return fallback(self)
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the engine must survive
                self._fail(fn.__name__, e)
                return fallback(self)

        return wrapper

    return deco


def plan_loads(plan: bytes) -> dict[str, list[int]]:
    """request id → G1 blocks of the loads in an encoded plan (goext/plan).
    The worker adapters learn a plan's loads from Go (kvbm._core.Worker.bind)
    and read a plan themselves only after kvbm failed in their process, to
    report the loads the engine still waits for."""
    return _plan.load_targets(plan)


class PlanSummary(TypedDict):
    """:func:`plan_summary` of a plan."""

    seq: int
    loads: dict[str, list[int]]  # request id -> G1 blocks its loads write
    saves: list[tuple[int, int, int]]  # (src G1 block, dst tier, dst block)
    moves: int
    drops: int


def plan_summary(plan: bytes) -> PlanSummary:
    """Counts and block lists of an encoded plan, for logs and tests:
    {"seq", "loads": {req: [g1...]}, "saves": [(src_g1, dst_tier, dst_block)],
    "moves": n, "drops": n}."""
    p = _plan.decode(plan)
    return {
        "seq": p["seq"],
        "loads": {r: [c[3] for c in cs] for r, cs in p["loads"].items()},
        "saves": [(c[1], c[2], c[3]) for c in p["saves"]],
        "moves": len(p["moves"]),
        "drops": len(p["drops"]),
    }


class FailureState:
    """Mixin: the ``_failed``/``_fail`` pair :func:`guarded` relies on."""

    _failed: str | None = None
    _log: logging.Logger = logging.getLogger("kvbm")
    _engine_name = "the engine"

    def _fail(self, where: str, err: Exception) -> None:
        self._failed = f"{where}: {err}"
        self._log.error(
            "kvbm failed in %s and is disabled for this process; %s keeps serving without kvbm's cache "
            "tiers. Cause: %s", where, self._engine_name, err)
