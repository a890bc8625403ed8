"""Operator calls to a running engine's kvbm: purge and stats.

The leader of every engine started with kvbm listens on a Unix socket
``kvbm-<pid>-<n>.sock`` in a directory private to the user (``DYN_KVBM_ADMIN_DIR``,
else ``$XDG_RUNTIME_DIR/kvbm``, else ``/tmp/kvbm-<uid>``), beside a token file
``kvbm-<pid>-<n>.token`` (0600). A call reads the token and sends it with the
request; the engine also checks that the caller runs as the same user.

    import kvbm.admin
    kvbm.admin.purge(salt="tenant-42")           # every tier, G4 objects included
    kvbm.admin.purge(prefix_tokens=[1, 2, 3, ...], salt="tenant-42")
    kvbm.admin.purge(all=True)
    kvbm.admin.stats()

With several engines of this user running, pass ``pid=`` (or ``socket=``).
The same calls are ``python -m kvbm purge|stats``.
"""

from __future__ import annotations

import json
import os
import socket as _socket
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["AdminError", "endpoint_dir", "endpoints", "purge", "stats", "call"]


class AdminError(RuntimeError):
    """A refused or failed operator request (the engine's message)."""


def endpoint_dir(directory: Optional[str] = None) -> Path:
    """The directory engines put their sockets in (see the module doc)."""
    d = directory or os.environ.get("DYN_KVBM_ADMIN_DIR", "")
    if d:
        return Path(d)
    run = os.environ.get("XDG_RUNTIME_DIR", "")
    if run and os.path.isabs(run):
        return Path(run) / "kvbm"
    return Path(tempfile.gettempdir()) / f"kvbm-{os.geteuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def endpoints(directory: Optional[str] = None) -> dict[int, list[Path]]:
    """Sockets of running engines, by process id (a process may hold several
    leaders: ``kvbm-<pid>-<n>.sock``)."""
    out: dict[int, list[Path]] = {}
    d = endpoint_dir(directory)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("kvbm-*-*.sock")):
        try:
            pid = int(p.name.split("-")[1])
        except ValueError:
            continue
        if _alive(pid):
            out.setdefault(pid, []).append(p)
    return out


def _pick(pid: Optional[int], sock: Optional[str], directory: Optional[str]) -> Path:
    if sock:
        return Path(sock)
    found = endpoints(directory)
    if pid is not None:
        if pid not in found:
            raise AdminError(f"no kvbm engine with pid {pid} in {endpoint_dir(directory)}")
        found = {pid: found[pid]}
    socks = [p for ps in found.values() for p in ps]
    if not socks:
        raise AdminError(
            f"no running kvbm engine found in {endpoint_dir(directory)} "
            "(set DYN_KVBM_ADMIN_DIR to the engine's, or pass socket=)")
    if len(socks) > 1:
        raise AdminError("several kvbm engines are running (" + ", ".join(str(p) for p in socks) +
                         "): pass pid= or socket=")
    return socks[0]


def call(request: dict[str, Any], *, pid: Optional[int] = None, socket: Optional[str] = None,
         directory: Optional[str] = None, timeout: float = 330.0) -> Any:
    """Send one request (its token added) and return the engine's result."""
    path = _pick(pid, socket, directory)
    token_file = path.with_name(path.name[:-len(".sock")] + ".token")
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        raise AdminError(f"cannot read the engine's token {token_file}: {e}") from e
    body = json.dumps(dict(request, token=token)).encode() + b"\n"
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except OSError as e:
            raise AdminError(f"cannot connect to {path}: {e}") from e
        s.sendall(body)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise AdminError(f"{path}: no reply")
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise AdminError(str(reply.get("error", "request failed")))
    return reply.get("result")


def purge(*, salt: Optional[str] = None, lora: Optional[Sequence[str]] = None,
          prefix_tokens: Optional[Sequence[int]] = None, all: bool = False,
          pid: Optional[int] = None, socket: Optional[str] = None,
          directory: Optional[str] = None) -> dict[str, Any]:
    """Purge a cache salt's blocks (with ``lora``: those it used with these
    LoRA adapters; without: those without an adapter), a prompt prefix and
    every block after it (hashed under ``salt``/``lora`` as the requests
    were), or everything, from G2, G3 (persistent file included) and G4.
    Returns what was removed (blocks per tier, objects deleted)."""
    req: dict[str, Any] = {"op": "purge"}
    if salt is not None:
        req["salt"] = salt
    if lora:
        req["loras"] = list(lora)
    if prefix_tokens is not None:
        toks = [int(t) for t in prefix_tokens]
        if not toks or any(t < 0 or t > 0xFFFFFFFF for t in toks):
            raise AdminError("prefix_tokens must be a non-empty list of token ids (0..2**32-1)")
        req["prefix_tokens"] = toks
    if all:
        req["all"] = True
    result = call(req, pid=pid, socket=socket, directory=directory)
    assert isinstance(result, dict)
    return result


def stats(*, pid: Optional[int] = None, socket: Optional[str] = None,
          directory: Optional[str] = None) -> dict[str, Any]:
    """Tier occupancy, hit rates, G4 registry size, purge and expiry counters."""
    result = call({"op": "stats"}, pid=pid, socket=socket, directory=directory)
    assert isinstance(result, dict)
    return result
