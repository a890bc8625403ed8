"""Reading (and, for tests, writing) the per-step plan the Go leader emits.

Format (goext/plan): a msgpack map {"q": seq, "l": [{"r": req_id, "c": copies}],
"m": copies, "v": copies, "x": copies, "g": group rows}; ``copies`` is a bin of little-endian
18-byte records (src tier u8, src block i64, dst tier u8, dst block i64).
Tiers: 1 = G1 (engine), 2 = G2 (host), 3 = G3 (disk), 4 = G4 (object storage;
its block is the sequence hash). "u" (G2 → G4 uploads) and "gs" (salts of salted G4
blocks, goext/plan/salts.go) are for the workers only.
"g" (KV cache groups): a bin of little-endian int64s, the number of groups n,
then per G1 block the plan copies: that block, then each group's block at its
position (-1: none) (:func:`group_rows`, :func:`with_group_rows`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias, TypedDict

import msgpack

_REC = struct.Struct("<BqBq")

# One block copy: (src tier, src block, dst tier, dst block).
Copy: TypeAlias = tuple[int, int, int, int]


class Plan(TypedDict):
    """A decoded plan (:func:`decode`)."""

    seq: int
    loads: dict[str, list[Copy]]  # request id -> its loads
    moves: list[Copy]
    saves: list[Copy]
    drops: list[Copy]


class WireCopy(TypedDict):
    """A copy as the wire's keys spell it (:func:`encode_map`)."""

    s: int
    sb: int
    d: int
    db: int


class WireLoad(TypedDict):
    r: str
    c: list[WireCopy]


class WirePlan(TypedDict, total=False):
    """A plan with the wire's keys (:func:`encode_map`)."""

    q: int
    l: list[WireLoad]  # noqa: E741 - the wire's key
    m: list[WireCopy]
    v: list[WireCopy]
    x: list[WireCopy]


def _copies(b: bytes | None) -> list[Copy]:
    return list(_REC.iter_unpack(b)) if b else []


def decode(plan: bytes) -> Plan:
    """{"seq", "loads": {req: [(src, src_block, dst, dst_block)]}, "moves", "saves", "drops"}."""
    if not plan:
        return {"seq": 0, "loads": {}, "moves": [], "saves": [], "drops": []}
    step: dict[str, Any] = msgpack.unpackb(plan, raw=False, strict_map_key=False)
    return {
        "seq": step.get("q", 0),
        "loads": {ld["r"]: _copies(ld.get("c")) for ld in step.get("l") or ()},
        "moves": _copies(step.get("m")),
        "saves": _copies(step.get("v")),
        "drops": _copies(step.get("x")),
    }


def encode(seq: int = 0, loads: Mapping[str, Iterable[Copy]] | None = None, moves: Iterable[Copy] = (),
           saves: Iterable[Copy] = (), drops: Iterable[Copy] = ()) -> bytes:
    """The inverse of :func:`decode` (tests build plans by hand with it)."""

    def pack(cs: Iterable[Copy]) -> bytes:
        return b"".join(_REC.pack(*c) for c in cs)

    m: dict[str, object] = {"q": seq}
    if loads:
        m["l"] = [{"r": r, "c": pack(cs)} for r, cs in loads.items()]
    for key, cs in (("m", moves), ("v", saves), ("x", drops)):
        if cs:
            m[key] = pack(cs)
    out: bytes = msgpack.packb(m, use_bin_type=True)
    return out


def encode_map(m: WirePlan) -> bytes:
    """:func:`encode` for a plan written with the wire's keys, copies as dicts:
    {"q", "l": [{"r", "c": [copy]}], "m"/"v"/"x": [copy]}, copy = {"s", "sb", "d", "db"}."""

    def tup(c: WireCopy) -> Copy:
        return (c["s"], c["sb"], c["d"], c["db"])

    return encode(
        seq=m.get("q", 0),
        loads={ld["r"]: [tup(c) for c in ld["c"]] for ld in m.get("l", [])},
        moves=[tup(c) for c in m.get("m", [])],
        saves=[tup(c) for c in m.get("v", [])],
        drops=[tup(c) for c in m.get("x", [])],
    )


def load_targets(plan: bytes) -> dict[str, list[int]]:
    """request id → the G1 blocks its loads write (staging copies into G2,
    such as G4 downloads, are not G1 blocks)."""
    return {r: [c[3] for c in cs if c[2] == 1] for r, cs in decode(plan)["loads"].items()}


def group_rows(plan: bytes) -> dict[int, list[int]]:
    """primary G1 block → the block of every KV cache group at its position
    (the plan's "g" rows, goext/plan/groups.go); {} without groups."""
    if not plan:
        return {}
    step: dict[str, Any] = msgpack.unpackb(plan, raw=False, strict_map_key=False)
    b = step.get("g")
    if not b:
        return {}
    vals = struct.unpack(f"<{len(b) // 8}q", b)
    n = vals[0]
    return {vals[i]: list(vals[i + 1:i + 1 + n]) for i in range(1, len(vals), n + 1)}


def with_group_rows(plan: bytes, groups: int, rows: Mapping[int, Sequence[int]]) -> bytes:
    """The plan with "g" rows added: for each primary G1 block, the block of
    each of the ``groups`` groups at its position (-1: none)."""
    step: dict[str, Any] = msgpack.unpackb(plan, raw=False, strict_map_key=False)
    vals: list[int] = [groups]
    for primary, row in rows.items():
        if len(row) != groups:
            raise ValueError(f"group row of G1 block {primary} has {len(row)} entries, want {groups}")
        vals.append(int(primary))
        vals.extend(int(b) for b in row)
    step["g"] = struct.pack(f"<{len(vals)}q", *vals)
    out: bytes = msgpack.packb(step, use_bin_type=True)
    return out
