"""Layer ordering shared by the engine adapters."""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_ANY_INT = re.compile(r"(\d+)")


def layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m:
        return int(m.group(1))
    ints = _ANY_INT.findall(name)
    if not ints:
        raise ValueError(f"cannot find the layer index in KV cache name {name!r}")
    return int(ints[0])


def order_layers(names: Iterable[str]) -> list[str]:
    """Layer names sorted by the layer index in their name."""
    return sorted(names, key=layer_index)
