"""Reading (and, for tests, writing) the per-step plan the Go leader emits.

Format (goext/plan): a msgpack map {"q": seq, "l": [{"r": req_id, "c": copies}],
"m": copies, "v": copies, "x": copies}; ``copies`` is a bin of little-endian
18-byte records (src tier u8, src block i64, dst tier u8, dst block i64).
Tiers: 1 = G1 (engine), 2 = G2 (host), 3 = G3 (disk), 4 = G4 (object storage;
its block is the sequence hash). "u" (G2 → G4 uploads) is for the workers only.
"""

from __future__ import annotations

import struct

import msgpack

_REC = struct.Struct("<BqBq")


def _copies(b) -> list[tuple[int, int, int, int]]:
    return list(_REC.iter_unpack(b)) if b else []


def decode(plan: bytes) -> dict:
    """{"seq", "loads": {req: [(src, src_block, dst, dst_block)]}, "moves", "saves", "drops"}."""
    if not plan:
        return {"seq": 0, "loads": {}, "moves": [], "saves": [], "drops": []}
    step = msgpack.unpackb(plan, raw=False, strict_map_key=False)
    return {
        "seq": step.get("q", 0),
        "loads": {ld["r"]: _copies(ld.get("c")) for ld in step.get("l") or ()},
        "moves": _copies(step.get("m")),
        "saves": _copies(step.get("v")),
        "drops": _copies(step.get("x")),
    }


def encode(seq=0, loads=None, moves=(), saves=(), drops=()) -> bytes:
    """The inverse of :func:`decode` (tests build plans by hand with it)."""

    def pack(cs):
        return b"".join(_REC.pack(*c) for c in cs)

    m: dict = {"q": seq}
    if loads:
        m["l"] = [{"r": r, "c": pack(cs)} for r, cs in loads.items()]
    for key, cs in (("m", moves), ("v", saves), ("x", drops)):
        if cs:
            m[key] = pack(cs)
    return msgpack.packb(m, use_bin_type=True)


def encode_map(m: dict) -> bytes:
    """:func:`encode` for a plan written with the wire's keys, copies as dicts:
    {"q", "l": [{"r", "c": [copy]}], "m"/"v"/"x": [copy]}, copy = {"s", "sb", "d", "db"}."""

    def tup(c):
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
