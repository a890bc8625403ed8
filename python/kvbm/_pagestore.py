"""Binding of kvbm's keyed page store (capi/pagestore.go, goext/pagestore):
pages named by an engine's own key strings, held in the disk tier (G3),
persistent across restarts when DYN_KVBM_DISK_PERSIST is on. The SGLang
HiCache backend (kvbm.sglang_integration) is built on it.

Pages cross as (address, length) segments of host memory, in order: the
caller keeps the memory alive for the duration of the call.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_int64, c_uint8, c_uint64, c_void_p
from typing import Any

from kvbm import _native

_ERR = POINTER(c_char_p)

_native.register_signatures(
    {
        "kvbm_pagestore_new": (c_int, [c_char_p, POINTER(c_uint64), _ERR]),
        "kvbm_pagestore_free": (None, [c_uint64]),
        "kvbm_pagestore_info": (c_int, [c_uint64, POINTER(POINTER(c_uint8)), POINTER(c_int64), _ERR]),
        "kvbm_pagestore_put": (
            c_int,
            [c_uint64, c_void_p, c_int64, POINTER(c_int64), c_int64, POINTER(c_uint64), c_int64, POINTER(c_int64),
             c_int64, c_void_p, c_int64, _ERR],
        ),
        "kvbm_pagestore_get": (
            c_int,
            [c_uint64, c_void_p, c_int64, POINTER(c_int64), c_int64, POINTER(c_uint64), c_int64, POINTER(c_int64),
             c_int64, c_void_p, c_int64, _ERR],
        ),
        "kvbm_pagestore_exists": (
            c_int,
            [c_uint64, c_void_p, c_int64, POINTER(c_int64), c_int64, POINTER(c_int64), _ERR],
        ),
        "kvbm_pagestore_has": (
            c_int,
            [c_uint64, c_void_p, c_int64, POINTER(c_int64), c_int64, c_void_p, c_int64, _ERR],
        ),
        "kvbm_pagestore_clear": (c_int, [c_uint64, _ERR]),
    }
)


def _keys(keys: Sequence[str]) -> tuple[Any, int, Any, int]:
    """(buffer, length, end offsets, count) of keys for the C ABI."""
    enc = [k.encode() for k in keys]
    blob = b"".join(enc)
    ends = (c_int64 * max(1, len(enc)))()
    pos = 0
    for i, e in enumerate(enc):
        pos += len(e)
        ends[i] = pos
    buf = ctypes.create_string_buffer(blob, max(1, len(blob)))
    return buf, len(blob), ends, len(enc)


class PageStore(_native.Handle):
    """A page store: ``identity`` (model, parallel and page layout, dtype)
    names its file and salts every key, so stores of incompatible setups
    never share a page; ``env`` is kvbm's configuration (DYN_KVBM_DISK_*).
    ``share`` is the fraction of the disk tier's size it gets (one store per
    pool of a hybrid model); ``pool`` labels its counters on kvbm's metrics
    endpoint; ``consolidator`` (a :class:`kvbm.Consolidator` started with
    engine "sglang") receives its pages as disk tier events under SGLang's
    event hash of each key."""

    _free = "kvbm_pagestore_free"

    def __init__(self, identity: str, page_bytes: int, *, rank: int = 0, env: Mapping[str, str] | None = None,
                 share: float = 0.0, pool: str = "kv", consolidator: Any = None):
        opts: dict[str, Any] = {"identity": identity, "page_bytes": int(page_bytes), "rank": int(rank),
                                "env": dict(_native.env_snapshot() if env is None else env),
                                "share": float(share), "pool": pool}
        if consolidator is not None:
            opts["consolidator"] = int(consolidator._h)
        h = c_uint64()
        _native.call("kvbm_pagestore_new", json.dumps(opts).encode(), byref(h))
        self._h = h.value
        self.page_bytes = int(page_bytes)

    def _io(self, name: str, keys: Sequence[str], pages: Sequence[Sequence[tuple[int, int]]]) -> list[bool]:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if not keys:
            return []
        buf, n_bytes, ends, n = _keys(keys)
        flat: list[int] = []
        page_ends = (c_int64 * n)()
        for i, segs in enumerate(pages):
            for addr, length in segs:
                flat += (addr, length)
            page_ends[i] = len(flat) // 2
        seg_arr = (c_uint64 * max(1, len(flat)))(*flat)
        ok = (c_uint8 * n)()
        _native.call(name, self._h, buf, n_bytes, ends, n, seg_arr, len(flat), page_ends, n, ok, n)
        return [bool(v) for v in ok]

    def put(self, keys: Sequence[str], pages: Sequence[Sequence[tuple[int, int]]]) -> list[bool]:
        """Store pages under ``keys``; each page is its (address, length)
        segments in order. True where the store holds the key after."""
        return self._io("kvbm_pagestore_put", keys, pages)

    def get(self, keys: Sequence[str], pages: Sequence[Sequence[tuple[int, int]]]) -> list[bool]:
        """Read ``keys`` into the pages' segments; False for a key not held or
        a page that fails its checks (its memory is then left as it was)."""
        return self._io("kvbm_pagestore_get", keys, pages)

    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds."""
        if not keys:
            return 0
        buf, n_bytes, ends, n = _keys(keys)
        hits = c_int64()
        _native.call("kvbm_pagestore_exists", self._h, buf, n_bytes, ends, n, byref(hits))
        return hits.value

    def has(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each of ``keys`` (disk tier, else the
        object tier), key by key."""
        if not keys:
            return []
        buf, n_bytes, ends, n = _keys(keys)
        ok = (c_uint8 * n)()
        _native.call("kvbm_pagestore_has", self._h, buf, n_bytes, ends, n, ok, n)
        return [bool(v) for v in ok]

    def clear(self) -> None:
        _native.call("kvbm_pagestore_clear", self._h)

    def info(self) -> dict[str, Any]:
        """Counters and the tier file (JSON of goext/pagestore.Stats)."""
        out = POINTER(c_uint8)()
        n = c_int64()
        _native.call("kvbm_pagestore_info", self._h, byref(out), byref(n))
        info: dict[str, Any] = json.loads(_native.take_buffer(out, n))
        return info


__all__ = ["PageStore"]
