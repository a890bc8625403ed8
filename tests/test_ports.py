"""kvbm.testing.ports: the ports tests name before a child process binds them."""

from __future__ import annotations

import socket

import pytest

from kvbm.testing import ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    lo, hi = ports._ephemeral_range()
    got = ports.free_ports(8)
    assert len(set(got)) == 8, got
    assert all(_bindable(p) for p in got), got
    if lo - ports._LOWEST >= 1000:
        # The kernel never hands these out for bind(0) or a connection.
        assert all(ports._LOWEST <= p < lo for p in got), (got, lo, hi)


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        monkeypatch.setattr(ports, "_LOWEST", taken)
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (taken + 1000, 65535))
        # 15 ports sample the whole 1000-port range, the taken one included.
        got = ports.free_ports(15)
        assert taken not in got
        assert len(set(got)) == 15
        assert all(taken < p < taken + 1000 for p in got), got
    finally:
        held.close()


def test_without_room_below_the_ephemeral_range_the_os_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    got = ports.free_ports(3)
    assert len(set(got)) == 3
    assert all(_bindable(p) for p in got)
