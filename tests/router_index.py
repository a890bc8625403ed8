"""A small KV-router index for tests: applies the consolidator's output and
reports what a real router would choke on.

It mirrors the behaviour of Dynamo's radix-tree indexer (per worker, blocks
looked up by their external ``block_hash``, each linked to its parent): a
STORE whose parent is unknown cannot be attached (``ParentBlockNotFound``
in the reference), a REMOVE of an unknown block fails (``BlockNotFound``).
On top of that it flags a block stored twice and a block stored as its own
parent, which a correct consolidator never sends.

Two input formats, both as already-decoded Python values:

* the consolidated ZMQ stream (vLLM wire format): a batch
  ``[ts, [event, ...], dp_rank]`` (or its map form), or a single event as a
  tagged array ``["BlockStored", hashes, parent, token_ids, block_size,
  lora_id, medium, lora_name, ...]``, ``["BlockRemoved", hashes, ...]``,
  ``["AllBlocksCleared", ...]`` or a tagged map with ``"type"``; hashes may
  be signed (bit-cast to u64) or bytes (last 8 bytes, big-endian);
* RouterEvent JSON dicts (NATS): ``{"worker_id", "storage_tier", "event":
  {"event_id", "data": {"stored": ...} | {"removed": ...} | "cleared",
  "dp_rank"}}``. Event ids are checked: a repeated id (at-least-once
  redelivery) is skipped and counted, a gap (dropped events) is reported.

With ``per_medium=True`` it reads vLLM's own event stream, where each tier
reports its own stores and removals under the same block hash (``medium``
GPU, CPU, STORAGE; a non-LOCAL ``locality`` makes another tier, named
``STORAGE@REMOTE`` for object storage), as routers that track a block's
tiers do: a block is
stored once per medium (again in the same medium is ``DUPLICATE_STORE``),
removed per medium (from a medium that does not hold it is
``REMOVE_UNKNOWN``) and leaves the index when no medium holds it; its
parent must be known in some medium when it first enters the index.
``AllBlocksCleared`` (vLLM's GPU block pool's) clears the GPU medium.

Pure Python; ``apply_zmq_frames`` needs ``msgpack`` only when called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

U64 = (1 << 64) - 1

# Inconsistency kinds.
STORE_UNKNOWN_PARENT = "store_unknown_parent"
REMOVE_UNKNOWN = "remove_unknown"
DUPLICATE_STORE = "duplicate_store"
SELF_PARENT = "self_parent"
EVENT_ID_GAP = "event_id_gap"
MALFORMED = "malformed"


def to_u64(h: Any) -> int:
    """An external hash as the consolidator reads it: ints bit-cast to u64,
    bytes reduced to their last 8 bytes big-endian."""
    if isinstance(h, bool):
        raise TypeError("a hash cannot be a bool")
    if isinstance(h, int):
        return h & U64
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise TypeError(f"a hash must be int or bytes, got {type(h).__name__}")


@dataclass
class Block:
    block_hash: int
    parent: Optional[int]
    tokens_hash: Optional[int] = None  # RouterEvent input
    tokens: Optional[tuple] = None  # ZMQ input
    children: set = field(default_factory=set)
    media: set = field(default_factory=set)  # per_medium: the tiers holding it


@dataclass
class Inconsistency:
    kind: str
    worker: int
    detail: str

    def __str__(self) -> str:
        return f"[worker {self.worker}] {self.kind}: {self.detail}"


class RouterIndex:
    """Per-worker index of block hashes; see the module docstring."""

    def __init__(self, per_medium: bool = False) -> None:
        self.per_medium = per_medium
        self.workers: dict[int, dict[int, Block]] = {}
        self.inconsistencies: list[Inconsistency] = []
        self.last_event_id: dict[int, int] = {}
        self.redelivered = 0  # RouterEvents skipped as already seen
        self.stores = 0
        self.removes = 0
        self.clears = 0

    # ------------------------------------------------------------ queries
    def blocks(self, worker: int = 0) -> dict[int, Block]:
        return self.workers.get(worker, {})

    def contains(self, block_hash: int, worker: int = 0) -> bool:
        return to_u64(block_hash) in self.blocks(worker)

    def __len__(self) -> int:
        return sum(len(b) for b in self.workers.values())

    @property
    def ok(self) -> bool:
        return not self.inconsistencies

    def kinds(self) -> list[str]:
        return [i.kind for i in self.inconsistencies]

    def assert_consistent(self) -> None:
        if self.inconsistencies:
            lines = "\n".join(str(i) for i in self.inconsistencies[:50])
            raise AssertionError(f"{len(self.inconsistencies)} router index inconsistencies:\n{lines}")

    # ------------------------------------------------------------- input
    def apply(self, event: Any, worker: int = 0) -> None:
        """Apply one RouterEvent dict, one decoded ZMQ batch, or one decoded
        ZMQ event (for ``worker``)."""
        if isinstance(event, dict) and "event" in event and "worker_id" in event:
            self._apply_router_event(event)
        elif isinstance(event, dict) and "events" in event:
            self.apply_batch(event, worker)
        elif isinstance(event, dict) and "type" in event:
            self._apply_zmq_event(event, worker)
        elif isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
            self._apply_zmq_event(event, worker)
        elif isinstance(event, (list, tuple)) and len(event) >= 2 and isinstance(event[1], (list, tuple)):
            self.apply_batch(event, worker)
        else:
            self._bad(worker, f"unrecognised event {event!r:.200}")

    def apply_all(self, evs: Iterable[Any], worker: int = 0) -> None:
        for ev in evs:
            self.apply(ev, worker)

    def apply_batch(self, batch: Any, worker: int = 0) -> None:
        """A decoded consolidated batch: [ts, events, dp_rank] or a map."""
        evs = batch.get("events") if isinstance(batch, dict) else batch[1]
        for ev in evs or []:
            self._apply_zmq_event(ev, worker)

    def apply_zmq_frames(self, frames: list, worker: int = 0) -> None:
        """A raw consolidated ZMQ message: [topic, seq, payload] or [topic, payload]."""
        import msgpack  # only needed here

        if len(frames) not in (2, 3):
            self._bad(worker, f"message has {len(frames)} frames, want 2 or 3")
            return
        self.apply_batch(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False), worker)

    # --------------------------------------------------------- internals
    def _bad(self, worker: int, detail: str) -> None:
        self.inconsistencies.append(Inconsistency(MALFORMED, worker, detail))

    def _apply_zmq_event(self, ev: Any, worker: int) -> None:
        try:
            if isinstance(ev, dict):
                tag = ev["type"]
                hashes = ev.get("block_hashes", [])
                parent = ev.get("parent_block_hash")
                tokens = ev.get("token_ids", [])
                block_size = ev.get("block_size", 0)
                medium = ev.get("medium")
                locality = ev.get("locality")
            else:
                tag = ev[0]
                hashes = ev[1] if len(ev) > 1 else []
                parent = ev[2] if len(ev) > 2 else None
                tokens = ev[3] if len(ev) > 3 else []
                block_size = ev[4] if len(ev) > 4 else 0
                if tag == "BlockStored":
                    medium = ev[6] if len(ev) > 6 else None
                else:
                    medium = ev[2] if tag == "BlockRemoved" and len(ev) > 2 else None
                locality = None
            medium = medium or "GPU"
            if locality not in (None, "LOCAL"):
                # A remote tier of the same medium is another tier (vLLM's
                # object-storage tier: STORAGE, REMOTE).
                medium = f"{medium}@{locality}"
            if tag == "BlockStored":
                if not block_size or block_size <= 0:
                    self._bad(worker, f"BlockStored with block_size {block_size}")
                    return
                prev = None if parent is None else to_u64(parent)
                for i, h in enumerate(hashes):
                    chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
                    h = to_u64(h)
                    self._store(worker, h, prev, tokens=chunk, medium=medium)
                    prev = h
            elif tag == "BlockRemoved":
                for h in hashes:
                    self._remove(worker, to_u64(h), medium=medium)
            elif tag == "AllBlocksCleared":
                self._clear(worker, medium="GPU")
            else:
                self._bad(worker, f"unknown event type {tag!r}")
        except (TypeError, KeyError, IndexError) as e:
            self._bad(worker, f"{e} in {ev!r:.200}")

    def _apply_router_event(self, re: dict) -> None:
        worker = int(re["worker_id"])
        inner = re["event"]
        eid = int(inner["event_id"])
        last = self.last_event_id.get(worker)
        if last is not None and eid <= last:
            self.redelivered += 1
            return
        if last is not None and eid != last + 1:
            self.inconsistencies.append(Inconsistency(
                EVENT_ID_GAP, worker, f"event_id {eid} after {last}: {eid - last - 1} event(s) missing"))
        self.last_event_id[worker] = eid
        data = inner["data"]
        if data == "cleared":
            self._clear(worker)
        elif isinstance(data, dict) and "stored" in data:
            st = data["stored"]
            prev = st.get("parent_hash")
            for blk in st["blocks"]:
                h = int(blk["block_hash"])
                self._store(worker, h, prev, tokens_hash=int(blk["tokens_hash"]))
                prev = h
        elif isinstance(data, dict) and "removed" in data:
            for h in data["removed"]["block_hashes"]:
                self._remove(worker, int(h))
        else:
            self._bad(worker, f"unknown RouterEvent data {data!r:.200}")

    def blocks_in(self, medium: str, worker: int = 0) -> set[int]:
        """per_medium: the hashes a medium holds."""
        return {h for h, b in self.blocks(worker).items() if medium in b.media}

    def _store(self, worker: int, h: int, parent: Optional[int], tokens=None, tokens_hash=None,
               medium: str = "GPU") -> None:
        idx = self.workers.setdefault(worker, {})
        self.stores += 1
        if self.per_medium and h in idx and parent != h:
            if medium in idx[h].media:
                self.inconsistencies.append(Inconsistency(
                    DUPLICATE_STORE, worker, f"block {h} stored twice in {medium}"))
            idx[h].media.add(medium)
            return
        if parent is not None and parent == h:
            self.inconsistencies.append(Inconsistency(SELF_PARENT, worker, f"block {h} names itself as parent"))
            return
        if h in idx:
            self.inconsistencies.append(Inconsistency(DUPLICATE_STORE, worker, f"block {h} stored twice"))
            return
        if parent is not None and parent not in idx:
            self.inconsistencies.append(Inconsistency(
                STORE_UNKNOWN_PARENT, worker, f"block {h} stored with unknown parent {parent}"))
            return  # the router cannot attach it, so it does not index it
        idx[h] = Block(h, parent, tokens_hash=tokens_hash, tokens=tokens, media={medium})
        if parent is not None:
            idx[parent].children.add(h)

    def _remove(self, worker: int, h: int, medium: str = "GPU") -> None:
        idx = self.workers.setdefault(worker, {})
        self.removes += 1
        if self.per_medium:
            held = idx.get(h)
            if held is None or medium not in held.media:
                self.inconsistencies.append(Inconsistency(
                    REMOVE_UNKNOWN, worker, f"remove of block {h} from {medium}, which does not hold it"))
                return
            held.media.discard(medium)
            if held.media:
                return
        blk = idx.pop(h, None)
        if blk is None:
            self.inconsistencies.append(Inconsistency(REMOVE_UNKNOWN, worker, f"remove of unknown block {h}"))
            return
        if blk.parent is not None and blk.parent in idx:
            idx[blk.parent].children.discard(h)

    def _clear(self, worker: int, medium: str = "GPU") -> None:
        self.clears += 1
        if not self.per_medium:
            self.workers[worker] = {}
            return
        idx = self.workers.setdefault(worker, {})
        for h in list(idx):
            idx[h].media.discard(medium)
            if not idx[h].media:
                del idx[h]
