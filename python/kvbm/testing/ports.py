"""Free TCP ports for tests that must name a port before something binds it
(a ZeroMQ endpoint given to a child process, a consolidator's output)."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports the OS had free on ``host``.

    Every probe socket stays bound until all ``n`` are chosen, so two calls
    in a row cannot hand out the same port (closing one probe before taking
    the next lets the OS pick it again). Another process may still take a
    port before the caller binds it; callers that can bind port 0 themselves
    should do that instead."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port the OS had free on ``host`` (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
