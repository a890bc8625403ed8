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

The record is for debugging; it never breaks or stalls the engine. The
recorded call only summarizes its record and queues it; a background
thread writes the file. When the writer falls behind (a slow disk), records
are dropped and counted, with one warning; their ``seq`` numbers are then
missing from the file. The file must be a regular file owned by this user,
writable by no one else and with one name; a missing one is created with
mode 0600. A symlink at the path is not followed and a FIFO is never waited
on: such a path, or one that cannot be written, turns recording off with
one warning per process. Every string is written as a JSON string, ``$``
and backquotes as ``\\u`` escapes too, so a request id chosen by a client
can neither break a line nor run in a shell that reads the file.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

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
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # NaN and Infinity are not JSON
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


# Records wait here for the writer thread; when it falls behind (a slow or
# stuck disk), further records are dropped rather than making the engine wait.
QUEUE_CAPACITY = 4096

# Shell-active characters, written as JSON escapes: the line parses to the
# same strings, and a record file sourced by mistake expands nothing.
_SHELL_ESCAPES = str.maketrans({"$": "\\u0024", "`": "\\u0060"})


def _line(rec: dict[str, Any]) -> str:
    """One record as one line of ASCII JSON. Every string (request ids and
    anything else an engine's client chose) is a JSON string: quotes,
    newlines and control characters escaped, nothing written raw."""
    text = json.dumps(rec, ensure_ascii=True, allow_nan=False, default=lambda o: {"type": type(o).__name__})
    return text.translate(_SHELL_ESCAPES) + "\n"


class RecordFileError(OSError):
    """The record path is not a file kvbm may write."""


def _open_record_file(path: str) -> int:
    """A write descriptor on path, which must be a regular file owned by this
    user, writable by no one else, with one name; a missing file is created
    (mode 0600). The open never follows a symlink (another user's link in
    /tmp must not aim the record at a file of ours) and never waits (a FIFO
    with no reader would block the engine for ever)."""
    base = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, base | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # A file, or a symlink (O_EXCL does not follow it either): checked below,
        # or ELOOP for the link.
        fd = os.open(path, base)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordFileError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_uid != os.geteuid():
            raise RecordFileError(f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise RecordFileError(f"writable by group or others (mode {stat.filemode(st.st_mode)})")
        if st.st_nlink != 1:
            raise RecordFileError(f"the file has {st.st_nlink} links (names); want 1")
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Sink:
    """One record file, shared by every recorder of the process.

    The recorded call only summarizes its record and appends it to a bounded
    queue (``submit``); a daemon writer thread, started by ``start``, formats
    and writes the records. When the queue is full the record is dropped and
    counted (``dropped``): its ``seq`` is then missing from the file.
    """

    def __init__(self, path: str, capacity: int = QUEUE_CAPACITY) -> None:
        self.path = path
        self.capacity = capacity
        self.cond = threading.Condition()
        # Guarded by cond:
        self.pending: collections.deque[dict[str, Any]] = collections.deque()
        self.seq = 0  # calls seen, recorded or dropped
        self.accepted = 0  # records queued
        self.done = 0  # records the writer is finished with (written or failed)
        self.dropped = 0
        self.off = False  # the file cannot be written: recording is off
        # Owned by the writer thread once started:
        self.fd: int | None = None
        self.failures = 0
        self.thread: threading.Thread | None = None

    def open(self) -> bool:
        """Open the record file; on failure, one warning and recording off."""
        try:
            self.fd = _open_record_file(self.path)
            return True
        except OSError as e:
            self._turn_off(e)
            return False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvbm-record", daemon=True)
        self.thread.start()

    def _turn_off(self, e: BaseException) -> None:
        with self.cond:
            self.off = True
            self.done += len(self.pending)
            self.pending.clear()
            self.cond.notify_all()
        log.warning("kvbm: cannot write the call record to %s (%s): %s; "
                    "the engine continues, calls are not recorded", self.path, PATH_ENV, e)

    def submit(self, rec: dict[str, Any]) -> None:
        """Queue rec for the writer; never waits for I/O."""
        first_drop = False
        with self.cond:
            if self.off:
                return
            rec["seq"] = self.seq
            self.seq += 1
            if len(self.pending) >= self.capacity:
                self.dropped += 1
                first_drop = self.dropped == 1
            else:
                self.pending.append(rec)
                self.accepted += 1
                self.cond.notify_all()
        if first_drop:
            log.warning("kvbm: the call record %s is %d records behind; dropping records until it "
                        "catches up (their seq numbers are missing from the file)", self.path, self.capacity)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the records queued so far are written (or given up);
        whether they were within timeout."""
        with self.cond:
            target = self.accepted
            return self.cond.wait_for(lambda: self.done >= target, timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.pending) or self.off)
                if self.off:
                    return
                batch = list(self.pending)
                self.pending.clear()
            lines = []
            for rec in batch:
                try:
                    lines.append(_line(rec))
                except Exception:  # noqa: BLE001 - a record never breaks the engine
                    lines.append(_line({"seq": rec.get("seq"), "method": rec.get("method"),
                                        "unrecorded": "not JSON"}))
            try:
                self._write_lines(lines)
            except OSError as e:
                with self.cond:
                    self.done += len(batch)
                fd, self.fd = self.fd, None
                if fd is not None:
                    os.close(fd)
                self._turn_off(e)
                return
            with self.cond:
                self.done += len(batch)
                self.cond.notify_all()

    def _write_lines(self, lines: list[str]) -> None:
        assert self.fd is not None
        data = memoryview("".join(lines).encode("ascii"))
        while data:
            n = os.write(self.fd, data)
            data = data[n:]


_sinks: dict[str, _Sink] = {}
_sinks_lock = threading.Lock()


def _sink(path: str) -> _Sink | None:
    """The sink of path, opened and started on first use; None (recording
    off) when the file cannot be written."""
    with _sinks_lock:
        s = _sinks.get(path)
        if s is None:
            s = _sinks[path] = _Sink(path)
            if s.open():
                s.start()
        return None if s.off else s


def flush(timeout: float | None = 5.0) -> bool:
    """Wait for every sink's queued records to be written; whether they were
    within timeout (each)."""
    with _sinks_lock:
        sinks = list(_sinks.values())
    return all([s.flush(timeout) for s in sinks])


atexit.register(flush, 2.0)


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
            sink.submit(rec)
            raise
        try:
            rec["output"] = summarize(out)
        except Exception as e:  # noqa: BLE001
            rec["output"] = {"unrecorded": type(e).__name__}
        sink.submit(rec)
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
    if sink is None:  # warned once
        return False
    for name in methods:
        fn = getattr(obj, name, None)
        if callable(fn):
            setattr(obj, name, _recorded(sink, engine, name, fn))
    log.info("kvbm: recording every %s scheduler-side connector call to %s (%s)", engine, path, ENABLE_ENV)
    return True
