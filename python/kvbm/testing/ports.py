"""Free TCP ports for tests that must name a port before something binds it
(a ZeroMQ endpoint given to a child process, a consolidator's output)."""

from __future__ import annotations

import random
import socket

# Ports the tests take from, below the kernel's ephemeral range: a port the
# kernel hands out for bind(0) or an outgoing connection (vLLM's and torch's
# own ports, any client socket) comes from that range, so one chosen there
# could be taken by the engine under test between the choice and the bind.
_LOWEST = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _probe(host: str, port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host``, outside the kernel's ephemeral
    range where it leaves room (see ``_LOWEST``), else any the OS hands out.

    Every probe socket stays bound until all ``n`` are chosen, so one call
    never hands out a port twice. Another process may still bind a port before
    the caller does, but only by asking for that very port; callers that can
    bind port 0 themselves should do that instead."""
    lo, _ = _ephemeral_range()
    socks: list[socket.socket] = []
    try:
        if lo - _LOWEST >= 1000:
            for port in random.sample(range(_LOWEST, lo), min(lo - _LOWEST, 64 * n + 64)):
                if len(socks) == n:
                    break
                s = _probe(host, port)
                if s is not None:
                    socks.append(s)
        while len(socks) < n:
            s = _probe(host, 0)
            if s is None:
                raise OSError(f"no free port on {host}")
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
