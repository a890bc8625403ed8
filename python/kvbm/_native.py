"""Lazy ctypes binding to kvbm's Go shared library.

The library is loaded on first use, never at import. The loading process id is
recorded; a call from any other process (a child forked after loading) raises
:class:`kvbm.KvbmForkError` instead of touching a Go runtime that did not
survive the fork.

Library choice: ``KVBM_LIBRARY`` (a path) wins; otherwise the CUDA variant
``lib/libkvbm_cuda.so`` when it is installed and a CUDA driver with a device is
usable, else the default ``lib/libkvbm.so``.
"""

from __future__ import annotations

import array
import ctypes
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint32, c_uint64, c_void_p
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict, TypeVar, Union

from kvbm import _affinity
from kvbm._errors import BY_CODE, KvbmError, KvbmForkError

if TYPE_CHECKING:
    from ctypes import _CDataType, _Pointer

    import numpy.typing as npt

# A token sequence as the hashing and match calls take it: a list (vLLM's
# ConstantList included), any other sequence of ints, a numpy array, or a
# buffer of 4-byte unsigned ints (array.array("I"), a memoryview of one).
Tokens: TypeAlias = Union[Sequence[int], "npt.NDArray[Any]", memoryview]

# ctypes signature of one export: (restype, argtypes).
Signature: TypeAlias = "tuple[type[_CDataType] | None, list[type[_CDataType]]]"

# (pointer, length, owner) of tokens converted for a call: the pointer is
# valid while owner is referenced; None with length 0.
TokenView: TypeAlias = "tuple[_Pointer[c_uint32] | None, int, object]"

log = logging.getLogger("kvbm")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_pid: int | None = None
_lib_path: str | None = None
_lib_variant: str | None = None

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _cuda_usable() -> bool:
    if os.environ.get("KVBM_DISABLE_CUDA", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    try:
        if cuda.cuInit(0) != 0:
            return False
        n = c_int(0)
        return cuda.cuDeviceGetCount(byref(n)) == 0 and n.value > 0
    except Exception:  # pragma: no cover - exotic drivers
        return False


def library_path() -> tuple[str, str]:
    """Return (path, variant) of the library that would be loaded."""
    env = os.environ.get("KVBM_LIBRARY")
    if env:
        return env, "custom"
    cuda_lib = os.path.join(_PKG_DIR, "lib", "libkvbm_cuda.so")
    if os.path.exists(cuda_lib) and _cuda_usable():
        return cuda_lib, "cuda"
    return os.path.join(_PKG_DIR, "lib", "libkvbm.so"), "default"


_P = POINTER
_ERR = _P(c_char_p)

# The library's own exports; leader, worker, consolidator and side-channel
# modules add theirs through register_signatures. capi/kvbm.h is the
# definition; tests/test_abi.py checks every entry against it.
_BASE_SIGNATURES: dict[str, Signature] = {
    "kvbm_version": (c_char_p, []),
    "kvbm_free_string": (None, [c_void_p]),
    "kvbm_free_buffer": (None, [c_void_p]),
    "kvbm_is_poisoned": (c_int, []),
    "kvbm_debug_panic": (c_int, [_ERR]),
    "kvbm_debug_panic_in_free": (None, []),
    "kvbm_salt_hash": (c_int, [c_char_p, c_int, c_char_p, c_int, _P(c_uint64), _ERR]),
    "kvbm_sequence_hashes": (c_int, [_P(c_uint32), c_int64, c_int64, c_uint64, _P(c_uint64), c_int64, _P(c_int64), _ERR]),
    "kvbm_router_hashes": (c_int, [_P(c_uint32), c_int64, c_int64, c_char_p, _P(c_uint64), c_int64, _P(c_int64), _ERR]),
    "kvbm_config_check": (c_int, [c_char_p, c_int, _P(_P(c_uint8)), _P(c_int64), _ERR]),
    "kvbm_build_info": (c_int, [_P(_P(c_uint8)), _P(c_int64), _ERR]),
}

# Exports only some builds have: the test-only ones (libkvbm_debug.so) and
# the CUDA variant's. Every other declared symbol must exist.
OPTIONAL_SYMBOLS = frozenset({"kvbm_debug_panic", "kvbm_debug_panic_in_free", "kvbm_worker_set_cuda_stream"})


def signatures() -> dict[str, Signature]:
    """Every ctypes signature the package declares: name -> (restype, argtypes)."""
    import kvbm._core  # noqa: F401  (registers leader, worker, consolidator)
    import kvbm._pagestore  # noqa: F401  (registers the page store)

    return {**_BASE_SIGNATURES, **_EXTRA_SIGNATURES}


def _declare(lib: ctypes.CDLL) -> None:
    missing: list[str] = []
    for name, (res, args) in {**_BASE_SIGNATURES, **_EXTRA_SIGNATURES}.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if name not in OPTIONAL_SYMBOLS:
                missing.append(name)
            continue
        fn.restype = res
        fn.argtypes = args
    if missing:
        raise KvbmError(
            f"kvbm native library {getattr(lib, '_name', '?')} lacks {', '.join(sorted(missing))}: it was built "
            f"from other sources than this Python package; rebuild it (`make build`) or reinstall kvbm"
        )


# Filled by modules that add exports (leader, worker, consolidator) through
# register_signatures.
_EXTRA_SIGNATURES: dict[str, Signature] = {}


def register_signatures(sigs: Mapping[str, Signature]) -> None:
    """Declare ctypes signatures of more exports (applied now if already loaded)."""
    _EXTRA_SIGNATURES.update(sigs)
    if _lib is not None:
        _declare(_lib)


def lib() -> ctypes.CDLL:
    """The loaded library; loads it on first use and enforces the owning pid."""
    global _lib, _lib_pid, _lib_path, _lib_variant
    pid = os.getpid()
    cur = _lib
    if cur is not None:
        if _lib_pid != pid:
            raise KvbmForkError(
                f"kvbm's native library was loaded by process {_lib_pid} and cannot be used from "
                f"process {pid} (a fork after loading). Create kvbm objects in the process that uses "
                f"them, or start workers with the 'spawn' method."
            )
        return cur
    with _lock:
        if _lib is None:
            path, variant = library_path()
            if not os.path.exists(path):
                raise KvbmError(
                    f"kvbm native library not found at {path}; build it with `make build` or reinstall "
                    f"with `pip install .` (needs Go)"
                )
            # The Go runtime starts its threads during the load: off the
            # cores an engine bound its model to (kvbm._affinity).
            cores = _affinity.runtime_cores()
            with _affinity.on_cores(cores):
                handle = ctypes.CDLL(path)
            _declare(handle)
            if cores:
                log.info("kvbm: threads on cores %s, off the engine's model cores", sorted(cores))
            _lib, _lib_pid, _lib_path, _lib_variant = handle, pid, path, variant
            log.info("kvbm %s: loaded %s library %s (pid %d)", version(), variant, path, pid)
    return lib()


def loaded_variant() -> str | None:
    """The variant of the loaded library ("default", "cuda", "custom"); None before loading."""
    return _lib_variant


def loaded_path() -> str | None:
    """The path of the loaded library; None before loading."""
    return _lib_path


class BuildInfo(TypedDict):
    """kvbm_build_info's answer (capi/buildinfo.go)."""

    variant: str  # "host" or "cuda": whether G1 may be GPU memory
    version: str
    go: str


_build_info: BuildInfo | None = None


def build_info() -> BuildInfo:
    """What the loaded library says of its own build (loads it). The adapters
    decide from its variant whether GPU tensors can be handed to it, whatever
    the library's file name (KVBM_LIBRARY may name any file)."""
    global _build_info
    if _build_info is None:
        out, n = _P(c_uint8)(), c_int64()
        call("kvbm_build_info", byref(out), byref(n))
        _build_info = json.loads(take_buffer(out, n))
    return _build_info


def has_cuda() -> bool:
    """Whether the loaded library is the CUDA build (its own answer)."""
    return build_info()["variant"] == "cuda"


def version() -> str:
    loaded = _lib if _lib is not None else lib()
    raw: bytes = loaded.kvbm_version()  # bytes: its restype is c_char_p
    return raw.decode()


def call(name: str, *args: object) -> None:
    """Call export ``name`` with ``args`` plus the trailing error pointer."""
    loaded = lib()
    fn = getattr(loaded, name)
    err = c_char_p()
    rc = fn(*args, byref(err))
    if rc != 0:
        # The message buffer was malloc'ed by Go; read it before freeing.
        msg = ctypes.string_at(err) if err else b""
        if err:
            loaded.kvbm_free_string(err)
        raise BY_CODE.get(rc, KvbmError)(msg.decode("utf-8", "replace") or "unknown kvbm error", rc)


def take_buffer(ptr: _Pointer[c_uint8], n: c_int64) -> bytes:
    """Copy a buffer returned by Go and free it."""
    if not ptr or n.value == 0:
        return b""
    data = ctypes.string_at(ptr, n.value)
    lib().kvbm_free_buffer(ptr)
    return data


_H = TypeVar("_H", bound="Handle")


class Handle:
    """Base of the Python objects that own a native handle: ``close()`` frees it
    once through the export named by ``_free``; also a context manager, and
    best-effort freed when garbage collected."""

    _free: str = ""
    _h: int = 0

    def close(self) -> None:
        if self._h:
            try:
                getattr(lib(), self._free)(self._h)
            finally:
                self._h = 0

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort, e.g. at interpreter exit
        try:
            self.close()
        except Exception:
            pass


def is_poisoned() -> bool:
    return bool(lib().kvbm_is_poisoned())


def debug_panic() -> None:
    """Trigger a Go panic inside the library (tests: panic → exception, poison)."""
    call("kvbm_debug_panic")


_U32P = POINTER(c_uint32)


def _token_list(tokens: Tokens) -> Tokens:
    """The plain list behind a token sequence where there is one: vLLM's
    ``Request.all_token_ids`` is a ``ConstantList`` over ``_all_token_ids``,
    and ``array.array.fromlist`` (the fastest conversion) takes only lists."""
    if type(tokens) is list:
        return tokens
    inner = getattr(tokens, "_x", None)
    return inner if type(inner) is list else tokens


def _u32_array(tokens: Tokens) -> TokenView:
    """(pointer, length, owner) for a token sequence; owner keeps the memory alive.

    Used in place, no copy: numpy arrays of uint32 (others are converted by
    numpy), and anything with the buffer protocol holding 4-byte unsigned ints
    (``array.array('I')``, a ``memoryview`` of one). Lists (vLLM's
    ConstantList included) are read in place by capi/pylist.c where CPython's
    layout is known (~2x faster than ``array.array.fromlist``, itself ~1.4x
    faster than ``array.array('I', list)`` and ~5x faster than
    ``numpy.array(list)``; bench/match_path.py measures them), else fromlist.
    """
    src = _token_list(tokens)
    if type(src) is not list:
        try:
            import numpy as np

            if isinstance(src, np.ndarray):
                arr = np.ascontiguousarray(src, dtype=np.uint32)
                return (arr.ctypes.data_as(_U32P) if len(arr) else None), len(arr), arr
        except ImportError:  # pragma: no cover
            pass
        mv = _buffer_view(src)
        if mv is not None and mv.format in ("I", "=I", "<I", "@I") and mv.itemsize == 4 and mv.ndim == 1 \
                and mv.c_contiguous:
            n = len(mv)
            if n == 0 or mv.readonly:
                # ctypes cannot take the address of a read-only buffer: copy.
                copy = array.array("I", mv.tobytes()) if n else array.array("I")
                return _array_view(copy)
            return ctypes.cast((ctypes.c_char * mv.nbytes).from_buffer(mv), _U32P), n, mv
        src = list(src)
    return _array_view(_list_to_u32(src))


def _buffer_view(obj: Any) -> memoryview | None:
    """A memoryview of ``obj`` when it has the buffer protocol, else None (no
    static type names the buffer protocol before Python 3.12, hence Any)."""
    try:
        return memoryview(obj)
    except TypeError:
        return None


# The in-place list reader (capi/pylist.c): None until first use, then the
# ctypes function (called with the GIL held) or False where it cannot be used.
_PylistReader: TypeAlias = "Callable[[list[int], array.array[int]], int]"
_pylist_fn: _PylistReader | Literal[False] | None = None
_PYLIST_MIN = 512  # shorter lists: fromlist is as fast as the extra call
_ZERO = (0,)


def pylist_layout() -> int:
    """CPython's int layout as capi/pylist.c knows it: 1 (3.9-3.11), 2
    (3.12-3.14), 0 where the in-place reader must not be used."""
    import sys
    import sysconfig

    if sys.implementation.name != "cpython" or sys.maxsize != 2**63 - 1 or hasattr(sys, "gettotalrefcount"):
        return 0  # not CPython, 32-bit, or a debug build (extra object header)
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return 0  # free-threaded: another object header
    if (3, 9) <= sys.version_info[:2] <= (3, 11):
        return 1
    if (3, 12) <= sys.version_info[:2] <= (3, 14):
        return 2
    return 0


def _pylist_reader() -> _PylistReader | Literal[False]:
    """The in-place reader, checked once against array.array on probe lists."""
    global _pylist_fn
    if _pylist_fn is not None:
        return _pylist_fn
    fn: _PylistReader | Literal[False] = False
    layout = pylist_layout()
    if layout and os.environ.get("KVBM_DISABLE_PYLIST_READER", "").lower() not in ("1", "true", "yes", "on"):
        sym = getattr(lib(), "kvbm_tokens_from_pylist", None)
        addr = ctypes.cast(sym, c_void_p).value if sym is not None else None
        if addr:
            proto = ctypes.PYFUNCTYPE(c_int64, ctypes.py_object, c_int64, ctypes.py_object, c_int32, c_void_p)
            raw = proto(addr)

            def read(lst: list[int], out: array.array[int], _raw: Any = raw, _layout: int = layout) -> int:
                got: int = _raw(lst, len(lst), int, _layout, out.buffer_info()[0])
                return got

            probe = [0, 1, 7, 255, 256, 1000, 150_000, 2**30 - 1, 2**30, 2**31 + 5, 2**32 - 1] * 60
            out = array.array("I", bytes(4 * len(probe)))
            good = read(probe, out) == len(probe) and out.tolist() == probe
            for bad in (-1, 2**32, True, 2**64):
                lst = [5, 6, bad, 7]
                good = good and read(lst, array.array("I", bytes(16))) == 2
            if good:
                fn = read
            else:
                log.warning("kvbm: in-place token list reader disabled (probe mismatch on %s)", layout)
    _pylist_fn = fn
    return fn


def _list_to_u32(src: list[int]) -> array.array[int]:
    """array.array('I') of a list: read in place where possible (capi/pylist.c,
    ~1 ns a token), the rest through fromlist (also the reference for errors:
    a negative or too large token raises OverflowError)."""
    n = len(src)
    if n >= _PYLIST_MIN:
        read = _pylist_reader()
        if read:
            arr = array.array("I", _ZERO) * n
            got = read(src, arr)
            if got == n:
                return arr
            del arr[got:]
            arr.fromlist(src[got:])
            return arr
    arr = array.array("I")
    arr.fromlist(src)
    return arr


def _array_view(arr: array.array[int]) -> TokenView:
    n = len(arr)
    if n == 0:
        return None, 0, arr
    return ctypes.cast(arr.buffer_info()[0], _U32P), n, arr


class TokenArray:
    """One request's tokens as uint32, converted once.

    vLLM asks to match a waiting request on every step it stays waiting, each
    time with the same token list (``Request._all_token_ids``, which only ever
    grows). A later call with the same list object converts only the tokens
    appended since; a different object, a shorter list, or a changed sample of
    the converted prefix (first, middle and last token) converts it all again.
    The Go side compares the tokens it receives with the request's copy and
    keeps the block hashes of the unchanged prefix, so a repeated call hashes
    nothing either.

    Holds a reference to the list until :meth:`clear` (the request finished).
    Not thread-safe: one per request, used from the engine's scheduler thread.
    """

    __slots__ = ("_src", "_arr")

    def __init__(self) -> None:
        self._src: list[int] | None = None
        self._arr: array.array[int] = array.array("I")

    def view(self, tokens: Tokens) -> TokenView:
        """(pointer, length, owner) of ``tokens`` like :func:`_u32_array`."""
        src = _token_list(tokens)
        if type(src) is not list:
            self.clear()
            return _u32_array(src)
        arr = self._arr
        n = len(arr)
        if src is self._src and len(src) >= n and (
                n == 0 or (src[0] == arr[0] and src[n >> 1] == arr[n >> 1] and src[n - 1] == arr[n - 1])):
            if len(src) > n:
                arr.fromlist(src[n:])
        else:
            arr = _list_to_u32(src)
            self._arr, self._src = arr, src
        return _array_view(arr)

    def clear(self) -> None:
        self._src = None
        self._arr = array.array("I")


def salt_hash(salt: str | None = None, lora_name: str | None = None) -> int:
    out = c_uint64()
    s = salt.encode() if salt is not None else None
    l = lora_name.encode() if lora_name is not None else None
    call("kvbm_salt_hash", s, int(salt is not None), l, int(lora_name is not None), byref(out))
    return out.value


def sequence_hashes(tokens: Tokens, block_size: int, *, salt_hash: int) -> list[int]:
    ptr, n, _keep = _u32_array(tokens)
    cap = n // block_size if block_size > 0 else 0
    out = (c_uint64 * max(cap, 1))()
    got = c_int64()
    call("kvbm_sequence_hashes", ptr, n, block_size, salt_hash, out, cap, byref(got))
    return list(out[: got.value])


def router_hashes(tokens: Tokens, block_size: int, *, lora_name: str | None = None) -> list[int]:
    ptr, n, _keep = _u32_array(tokens)
    cap = n // block_size if block_size > 0 else 0
    out = (c_uint64 * max(cap, 1))()
    got = c_int64()
    l = lora_name.encode() if lora_name else None
    call("kvbm_router_hashes", ptr, n, block_size, l, out, cap, byref(got))
    return list(out[: got.value])


# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY: the object tier's credentials
# when DYN_KVBM_OBJECT_ACCESS_KEY / _SECRET_KEY are unset.
_ENV_PREFIXES = ("DYN_KVBM_", "KVBM_CUDA_", "NATS_SERVER", "DYN_LOG", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Where kvbm keeps its per-user files (the persistent disk tier's default
# directory, the secret behind its MACs, the operator endpoint): read by name, not by prefix.
_ENV_NAMES = frozenset({"HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"})


def env_snapshot() -> dict[str, str]:
    """kvbm's variables as Python sees them now.

    Passed to every native constructor: a Go library loaded with dlopen reads
    the process environment as it was when the library was loaded, which can
    miss variables an engine sets later (os.environ is authoritative).
    """
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def config_check(require_tier: bool = False) -> str:
    """Validate the environment; returns the effective configuration summary."""
    import json

    buf = POINTER(c_uint8)()
    n = c_int64()
    call("kvbm_config_check", json.dumps(env_snapshot()).encode(), int(require_tier), byref(buf), byref(n))
    return take_buffer(buf, n).decode()
