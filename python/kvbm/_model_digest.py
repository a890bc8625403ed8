"""The model's identity in the block fingerprint: its name, its revision and
a digest of the files that identify its weights.

Blocks kept beyond a process (the persistent disk tier, object storage) are
keyed by a fingerprint that includes the string ``model_identity`` returns
(``goext/fingerprint``: ``Inputs.Model``). A name alone is not enough: a
rolling upgrade that puts new weights under the same path or hub id would
find the old weights' KV. So the identity also carries:

- ``#snapshot=<commit>`` when the weights are a Hugging Face hub snapshot
  (a directory ``.../snapshots/<40 hex digits>/``, given as a path or
  resolved from a hub id in the local cache, never over the network);
- ``#files=<digest>`` when the weights are a local directory (or file): the
  first 128 bits of a SHA-256 over the identity files (``config.json``,
  ``generation_config.json`` and every ``*.index.json``, whole) and, for each
  weight file (``*.safetensors``; without any, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf``, ``*.engine``), its size and its first MiB. Weights are never
  read whole: a safetensors file starts with its header (names, shapes,
  offsets) and its first tensors' bytes, so new weights change the digest
  even when the config and the index (which lists names, not contents) stay
  the same. File times are not used: two copies of one checkpoint match.

What it cannot see: weights changed only beyond the first MiB of every
weight file with the config, index and sizes unchanged. Give such weights a
new path or revision.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import struct
from typing import Any

IDENTITY_FILES = ("config.json", "generation_config.json")
INDEX_PATTERN = "*.index.json"
WEIGHT_PATTERNS = ("*.safetensors",)
FALLBACK_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.gguf", "*.engine")
HEAD_BYTES = 1 << 20
DIGEST_VERSION = b"kvbm-model-files-v1"

_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_CHUNK = 1 << 20


def model_identity(model: Any, revision: Any = None, cache_dir: str | None = None) -> str:
    """``<model>[@<revision>][#snapshot=<commit>][#files=<digest>]`` (see the
    module docstring); model is a name, a hub id or a local path; cache_dir
    is the engine's hub download directory when it is not the default."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    name = str(model) if isinstance(model, str) else ""
    rev = str(revision) if revision else ""
    ident = f"{name}@{rev}" if rev else name
    if not name:
        return ident
    local = name if os.path.exists(name) else _hub_snapshot(name, rev or None, cache_dir)
    if local is None:
        return ident
    commit = _snapshot_commit(local)
    if commit and commit != rev:
        ident += f"#snapshot={commit}"
    digest = files_digest(local)
    if digest:
        ident += f"#files={digest}"
    return ident


def files_digest(path: str) -> str:
    """The files digest of a model directory or single weight file (32 hex
    digits); "" when it holds none of the files."""
    entries = _identity_entries(path)
    if not entries:
        return ""
    h = hashlib.sha256()
    _put(h, DIGEST_VERSION)
    for name, kind in entries:
        _put(h, name.encode("utf-8", "surrogateescape"))
        _put(h, kind.encode())
        full = path if name == "" else os.path.join(path, name)
        if kind == "whole":
            _hash_file(h, full, None)
        else:
            _hash_file(h, full, HEAD_BYTES)
    return h.hexdigest()[:32]


def _identity_entries(path: str) -> list[tuple[str, str]]:
    """(name relative to path, "whole" or "head") of each file the digest
    covers, in a fixed order."""
    if os.path.isfile(path):
        return [("", "head")]
    if not os.path.isdir(path):
        return []
    whole = {n for n in IDENTITY_FILES if os.path.isfile(os.path.join(path, n))}
    whole.update(_names(path, (INDEX_PATTERN,)))
    heads = _names(path, WEIGHT_PATTERNS) or _names(path, FALLBACK_WEIGHT_PATTERNS)
    return [(n, "whole") for n in sorted(whole)] + [(n, "head") for n in sorted(heads - whole)]


def _names(path: str, patterns: tuple[str, ...]) -> set[str]:
    out: set[str] = set()
    for pat in patterns:
        for p in glob.glob(os.path.join(glob.escape(path), pat)):
            if os.path.isfile(p):
                out.add(os.path.basename(p))
    return out


def _put(h: Any, b: bytes) -> None:
    """Length-prefixed: no two entry lists share an encoding."""
    h.update(struct.pack("<Q", len(b)))
    h.update(b)


def _hash_file(h: Any, path: str, limit: int | None) -> None:
    """The file's size, then its bytes (the first limit of them); an
    unreadable file is digested as its error, so it never matches a
    readable one."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _put(h, b"ok")
            h.update(struct.pack("<Q", size))
            left = size if limit is None else min(size, limit)
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
    except OSError as e:
        _put(h, f"error:{type(e).__name__}".encode())


def _snapshot_commit(path: str) -> str:
    """The hub commit of a snapshot directory (or a file in one), else ""."""
    for p in (os.path.abspath(path), os.path.realpath(path)):
        m = _SNAPSHOT.search(p.replace(os.sep, "/"))
        if m:
            return m.group(1)
    return ""


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The local snapshot directory of a hub model the engine loaded, from
    the Hugging Face cache only (no network); None when there is none."""
    if repo_id.count("/") > 1 or repo_id.startswith(("/", ".")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        p = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # noqa: BLE001 - no hub library, or not a hub id
        return None
    return os.path.dirname(p) if isinstance(p, str) else None
