"""Exceptions raised by kvbm; each carries the native library's message."""

from __future__ import annotations


class KvbmError(RuntimeError):
    """Base class. ``code`` is the C ABI status code (0 never appears)."""

    code: int = 1

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class KvbmConfigError(KvbmError, ValueError):
    """Invalid configuration; the message names the environment variable."""

    code = 2


class KvbmIOError(KvbmError, OSError):
    """File system, network or memory-mapping failure."""

    code = 3


class KvbmStateError(KvbmError):
    """Unknown handle or a call in the wrong state."""

    code = 4


class KvbmInternalError(KvbmError):
    """A Go panic was caught at the boundary; the library is now poisoned."""

    code = 5


class KvbmPoisonedError(KvbmError):
    """An earlier internal error poisoned the library; restart the process."""

    code = 6


class KvbmForkError(KvbmError):
    """The native library was loaded by another process (this one was forked)."""

    code = 7


# Status code of a failed C ABI call -> its exception (capi/kvbm.h). 7 is
# never returned by the library: KvbmForkError is raised in Python.
BY_CODE: dict[int, type[KvbmError]] = {
    1: KvbmError,
    2: KvbmConfigError,
    3: KvbmIOError,
    4: KvbmStateError,
    5: KvbmInternalError,
    6: KvbmPoisonedError,
}
