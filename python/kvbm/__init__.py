"""kvbm: a multi-tier KV-cache block manager for LLM inference engines.

Importing this package never loads the native library: vLLM imports connector
modules in its front-end process and then forks, and a Go runtime does not
survive a fork. The library is loaded lazily by the first object that needs it
(see :mod:`kvbm._native`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from kvbm._errors import (  # noqa: F401  (re-exported)
    KvbmConfigError,
    KvbmError,
    KvbmForkError,
    KvbmInternalError,
    KvbmIOError,
    KvbmPoisonedError,
    KvbmStateError,
)

if TYPE_CHECKING:
    from kvbm._native import Tokens


def sequence_hashes(tokens: Tokens, block_size: int, *, salt: str | None = None,
                    lora_name: str | None = None) -> list[int]:
    """KVBM sequence hashes (design §3) of every full block of ``tokens``."""
    from kvbm import _native

    return _native.sequence_hashes(tokens, block_size, salt_hash=_native.salt_hash(salt, lora_name))


def router_hashes(tokens: Tokens, block_size: int, *, lora_name: str | None = None) -> list[int]:
    """Router sequence hashes (seed 1337) of every full block of ``tokens``."""
    from kvbm import _native

    return _native.router_hashes(tokens, block_size, lora_name=lora_name)
