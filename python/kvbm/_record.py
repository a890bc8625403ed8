"""DYN_KVBM_ENABLE_RECORD: a record of every scheduler-side connector call.

With ``DYN_KVBM_ENABLE_RECORD`` set to 1 or true, each call vLLM makes on
the scheduler-side ``DynamoConnector``, and each call TensorRT-LLM makes on
``DynamoKVBMConnectorLeader``, is appended as one JSON line to
``/tmp/records.jsonl`` (Dynamo's path; ``DYN_KVBM_RECORD_PATH`` overrides
it, a kvbm extension)::

    {"ts": 1764600000.1, "pid": 4242, "engine": "vllm", "seq": 7,
     "method": "get_num_new_matched_tokens",
     "inputs": {"request": {"request_id": "a", "num_tokens": 21, "num_computed_tokens": 0},
                "num_computed_tokens": 0},
     "output": [16, true]}

A call that raises has ``"error"`` instead of ``"output"``. Engine objects
that are not JSON (a request, a block list, a scheduler output) are
recorded as a compact summary: a request as its id and token counts, a
block list as its block ids, token lists as their length, bytes as their
length, other objects as their public attributes (four levels deep).

The record is for debugging; it never breaks the engine: a record that
cannot be made or written is skipped, with one warning per process.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvbm._envs import env_bool

log = logging.getLogger("kvbm")

ENABLE_ENV = "DYN_KVBM_ENABLE_RECORD"
PATH_ENV = "DYN_KVBM_RECORD_PATH"
DEFAULT_PATH = "/tmp/records.jsonl"

# The scheduler-side calls vLLM makes on a KV connector (KVConnectorBase_V1).
VLLM_SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "reset_cache",
    "set_xfer_handshake_metadata",
    "shutdown",
)

# The calls TensorRT-LLM makes on its KvCacheConnectorScheduler.
TRTLLM_LEADER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "cancel_load",
    "reset_cache",
    "wait_for_initialization",
    "shutdown",
)

_MAX_DEPTH = 4


def enabled() -> bool:
    """DYN_KVBM_ENABLE_RECORD (1/true; an unknown value raises ValueError naming it)."""
    return env_bool(ENABLE_ENV, False)


def record_path() -> str:
    raw = os.environ.get(PATH_ENV, "").strip()
    return raw or DEFAULT_PATH


def _is_token_key(key: str) -> bool:
    return key == "tokens" or "token_ids" in key or key.endswith("_tokens_list") or key == "new_tokens"


def _sequence_len(x: Any) -> int | None:
    if isinstance(x, (str, bytes, dict)) or not hasattr(x, "__len__") or not hasattr(x, "__iter__"):
        return None
    try:
        return len(x)
    except Exception:
        return None


def _request(x: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": summarize(x.request_id, _MAX_DEPTH)}
    for attr in ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "context_current_position"):
        try:
            v = getattr(x, attr, None)
        except Exception:
            continue
        if isinstance(v, int) and not isinstance(v, bool):
            out[attr] = v
    if "num_tokens" not in out:
        # TensorRT-LLM's LlmRequest: the tokens of beam 0.
        get_tokens = getattr(x, "get_tokens", None)
        if callable(get_tokens):
            try:
                out["num_tokens"] = len(get_tokens(0))
            except Exception:
                pass
    return out


def _int_lists(items: list[Any]) -> bool:
    """items are ints, or lists of ints (block ids per KV cache group)."""
    return all(
        (isinstance(i, int) and not isinstance(i, bool))
        or (isinstance(i, (list, tuple)) and all(isinstance(j, int) and not isinstance(j, bool) for j in i))
        for i in items
    )


def summarize(x: Any, depth: int = 0) -> Any:
    """A JSON-able, compact form of x (see the module docstring)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"bytes": len(x)}
    if isinstance(x, dict):
        if depth >= _MAX_DEPTH:
            return {"type": "dict", "len": len(x)}
        return {str(k): _field(str(k), v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = list(x)
        if isinstance(x, (set, frozenset)):
            try:
                items.sort()
            except TypeError:
                pass
        if depth >= _MAX_DEPTH:
            if _int_lists(items):  # block ids, per KV cache group: kept at any depth
                return [list(i) if isinstance(i, (list, tuple)) else i for i in items]
            return {"type": type(x).__name__, "len": len(items)}
        return [summarize(i, depth + 1) for i in items]
    if isinstance(x, type):
        return {"type": x.__name__}
    if hasattr(x, "request_id") and (hasattr(x, "num_tokens") or callable(getattr(x, "get_tokens", None))):
        return _request(x)  # vLLM's Request, TensorRT-LLM's LlmRequest
    get_block_ids = getattr(x, "get_block_ids", None)
    if callable(get_block_ids):  # vLLM's KVCacheBlocks
        try:
            return {"block_ids": summarize(get_block_ids(), depth + 1)}
        except Exception:
            pass
    if isinstance(getattr(x, "block_id", None), int):  # one vLLM KVCacheBlock
        return {"block_id": x.block_id}
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):  # a tensor or an array
        return {"type": type(x).__name__, "shape": [int(s) for s in shape], "dtype": str(x.dtype)}
    if depth >= _MAX_DEPTH:
        return {"type": type(x).__name__}
    if dataclasses.is_dataclass(x):
        fields = {f.name: getattr(x, f.name, None) for f in dataclasses.fields(x)}
    else:
        try:
            fields = dict(vars(x))
        except TypeError:
            n = _sequence_len(x)
            if n is not None:  # a sequence type of the engine's (vLLM's ConstantList)
                return [summarize(i, depth + 1) for i in x]
            return {"type": type(x).__name__}
    out: dict[str, Any] = {"type": type(x).__name__}
    for k, v in fields.items():
        if not k.startswith("_") and not callable(v):
            out[k] = _field(k, v, depth + 1)
    return out


def _field(key: str, v: Any, depth: int) -> Any:
    """A named value: a token list is recorded as its length."""
    if _is_token_key(key):
        if isinstance(v, dict):  # per request (vLLM's CachedRequestData.all_token_ids)
            return {str(k): _field(key, t, depth + 1) for k, t in v.items()}
        n = _sequence_len(v)
        if n is not None:
            return {"num_tokens": n}
    return summarize(v, depth)


class _Sink:
    """One record file, shared by every recorder of the process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.file: TextIO | None = None
        self.seq = 0
        self.failures = 0

    def write(self, rec: dict[str, Any]) -> None:
        with self.lock:
            try:
                rec["seq"] = self.seq
                line = json.dumps(rec, default=lambda o: {"type": type(o).__name__}) + "\n"
                if self.file is None:
                    self.file = open(self.path, "a", encoding="utf-8")
                self.file.write(line)
                self.file.flush()
                self.seq += 1
            except Exception as e:  # noqa: BLE001 - a record never breaks the engine
                self.failures += 1
                if self.failures == 1:
                    log.warning("kvbm: cannot write the call record to %s (%s=%s): %s; "
                                "the engine continues, calls are not recorded", self.path, PATH_ENV,
                                self.path, e)


_sinks: dict[str, _Sink] = {}
_sinks_lock = threading.Lock()


def _sink(path: str) -> _Sink:
    with _sinks_lock:
        s = _sinks.get(path)
        if s is None:
            s = _sinks[path] = _Sink(path)
        return s


def _recorded(sink: _Sink, engine: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None

    def inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if sig is not None:
            try:
                bound = sig.bind(*args, **kwargs)
                return {k: _field(k, v, 1) for k, v in bound.arguments.items()}
            except TypeError:
                pass
        return {"args": summarize(list(args), 1), "kwargs": summarize(kwargs, 1)}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        rec: dict[str, Any] = {"ts": time.time(), "pid": os.getpid(), "engine": engine, "method": name}
        try:
            rec["inputs"] = inputs(args, kwargs)
        except Exception as e:  # noqa: BLE001
            rec["inputs"] = {"unrecorded": type(e).__name__}
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            sink.write(rec)
            raise
        try:
            rec["output"] = summarize(out)
        except Exception as e:  # noqa: BLE001
            rec["output"] = {"unrecorded": type(e).__name__}
        sink.write(rec)
        return out

    return call


def record_calls(obj: Any, engine: str, methods: tuple[str, ...]) -> bool:
    """Record the calls to obj's methods (an instance's own attributes
    replace the bound methods) when DYN_KVBM_ENABLE_RECORD is on; returns
    whether it is."""
    if not enabled():
        return False
    path = record_path()
    sink = _sink(path)
    for name in methods:
        fn = getattr(obj, name, None)
        if callable(fn):
            setattr(obj, name, _recorded(sink, engine, name, fn))
    log.info("kvbm: recording every %s scheduler-side connector call to %s (%s)", engine, path, ENABLE_ENV)
    return True
