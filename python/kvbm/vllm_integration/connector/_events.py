"""kvbm's host (G2), disk (G3) and object store (G4) tiers in vLLM's own KV
event stream (``--kv-events-config``): the scheduler-side connector's
``take_events`` returns vLLM ``BlockStored`` / ``BlockRemoved`` events for
them, with the medium and locality vLLM's native offloading uses (``CPU`` /
``LOCAL`` for G2, ``STORAGE`` / ``LOCAL`` for G3, and ``STORAGE`` /
``REMOTE`` for G4, as vLLM's object-storage tier), so a router reading vLLM's
events sees kvbm's tiers without the consolidator.

G4's events say what this instance believes the bucket holds: a block is
stored when it enters the leader's G4 registry (an upload acknowledged, a
lookup that found it) and removed when it leaves it (LRU eviction from the
registry, a failed or unverifiable download). The registry knows hashes
only: a G4 store takes its tokens and parent from the request that named the
block.

The Go leader names blocks by kvbm's sequence hashes; vLLM's events name
them by vLLM's block hashes. Every full block the leader is sent is mapped
here from one to the other (the request's ``block_hashes`` at vLLM's block
size, beside kvbm's sequence hashes of the same tokens), so kvbm's events
carry the hash vLLM's own G1 events use for the same block.

Per tier, a block is announced once when the tier registers it and removed
once when the tier lets it go: a router that tracks the tiers of a block
(as for vLLM's native offloading) forgets it only when no tier holds it.
A store names its parent when a kvbm tier holds the parent (so the router
knows it); otherwise it is published as a first block, as the consolidator
does (design §7.2). Blocks whose vLLM hash is unknown (a persistent disk
tier's blocks recovered at start, or a block stored long after its request
was forgotten) are not published and are counted; so are their removals.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvbm import _native

if TYPE_CHECKING:
    from kvbm._core import Leader

try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    try:
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
    except ImportError:  # pragma: no cover - vLLM before the medium constants
        MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"
    _HAVE_EVENTS = True
except Exception:  # pragma: no cover - vLLM absent
    _HAVE_EVENTS = False
    MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"

LOCALITY = "LOCAL"
REMOTE = "REMOTE"  # G4: the bucket, shared by every instance


def events_enabled(vllm_config: Any) -> bool:
    """vLLM publishes KV cache events (``--kv-events-config`` with
    ``enable_kv_cache_events``)."""
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(_HAVE_EVENTS and kec is not None and getattr(kec, "enable_kv_cache_events", False))


def _external(h: Any) -> Any:
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except Exception:  # pragma: no cover - vLLM absent
        return h
    return maybe_convert_block_hash(h)


def _block_hashes(request: Any, block_size: int, hash_block_size: int) -> list[Any]:
    """The request's vLLM block hashes at the KV cache block size (vLLM
    hashes at ``hash_block_size``, which may divide the block size)."""
    hashes = getattr(request, "block_hashes", None)
    if not hashes:
        return []
    if hash_block_size == block_size:
        return list(hashes)
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    resolved = resolve_block_hashes(hashes, hash_block_size, block_size)
    return [resolved[i] for i in range(len(resolved))]


class _Block:
    __slots__ = ("external", "lora_id", "lora_name", "media", "parent", "tokens")

    def __init__(self, external: Any, lora_id: int | None, lora_name: str | None,
                 parent: int | None = None, tokens: tuple = ()) -> None:
        self.external = external
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.media: set[tuple[str, str]] = set()  # the tiers (medium, locality) that announced it
        self.parent = parent  # kvbm sequence hash of the previous block (G4 stores)
        self.tokens = tokens  # the block's tokens (G4 stores)


class TierEvents:
    """Maps kvbm's tier events to vLLM events (scheduler side, one per
    leader). Not thread-safe: vLLM's scheduler calls it from one thread."""

    def __init__(self, block_size: int, hash_block_size: int, max_pending: int) -> None:
        from kvbm._core import TIER_DISK, TIER_HOST, TIER_OBJECT  # with the leader: the native handles are loaded

        self._medium = {TIER_HOST: (MEDIUM_CPU, LOCALITY), TIER_DISK: (MEDIUM_STORAGE, LOCALITY),
                        TIER_OBJECT: (MEDIUM_STORAGE, REMOTE)}
        self._bs = block_size
        self._hash_bs = hash_block_size
        # kvbm sequence hash → block, for blocks some kvbm tier announced ...
        self._held: dict[int, _Block] = {}
        # ... and for blocks sent to the leader but not (or no longer) held,
        # oldest first, at most max_pending.
        self._pending: OrderedDict[int, _Block] = OrderedDict()
        self._max_pending = max(1, max_pending)
        self._mapped: dict[str, int] = {}  # request id → its blocks mapped so far
        self.unmapped = 0  # events not published: vLLM hash unknown
        self.dropped = 0  # events the leader dropped (not taken in time), as last reported

    def note_request(self, request: Any, salt_hash: int, resumed: bool = False) -> None:
        """Map the request's full blocks not mapped yet (call before the
        leader's step that may store them)."""
        rid = request.request_id
        done = 0 if resumed else self._mapped.get(rid, 0)
        tokens = request.all_token_ids
        full = len(tokens) // self._bs
        if full <= done:
            return
        ext = _block_hashes(request, self._bs, self._hash_bs)
        full = min(full, len(ext))
        if full <= done:
            return
        seq = _native.sequence_hashes(list(tokens[:full * self._bs]), self._bs, salt_hash=salt_hash)
        lr = getattr(request, "lora_request", None)
        lora_id = getattr(lr, "adapter_id", None) if lr is not None else None
        lora_name = getattr(lr, "name", None) if lr is not None else None
        for i in range(done, full):
            h = seq[i]
            if h in self._held:
                continue
            self._pending[h] = _Block(_external(ext[i]), lora_id, lora_name, parent=seq[i - 1] if i else None,
                                      tokens=tuple(tokens[i * self._bs:(i + 1) * self._bs]))
            self._pending.move_to_end(h)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
        self._mapped[rid] = full

    def forget_request(self, rid: str) -> None:
        self._mapped.pop(rid, None)

    def take(self, leader: Leader) -> list[Any]:
        """vLLM events for what kvbm's tiers stored and removed since the last call."""
        evs, self.dropped = leader.take_events()
        out: list[Any] = []
        for ev in evs:
            tier = self._medium.get(ev.tier)
            if tier is None:
                continue
            medium, locality = tier
            if ev.removed:
                b = self._held.get(ev.seq_hash)
                if b is None or tier not in b.media:
                    self.unmapped += 1  # never announced in this tier
                    continue
                b.media.discard(tier)
                if not b.media:  # no kvbm tier holds it: may be stored again
                    del self._held[ev.seq_hash]
                    self._pending[ev.seq_hash] = b
                    if len(self._pending) > self._max_pending:
                        self._pending.popitem(last=False)
                out.append(BlockRemoved(block_hashes=[b.external], medium=medium, group_idx=0, locality=locality))
                continue
            b = self._held.get(ev.seq_hash)
            if b is None:
                b = self._pending.pop(ev.seq_hash, None)
                if b is None:
                    self.unmapped += 1
                    continue
                self._held[ev.seq_hash] = b
            if tier in b.media:
                continue
            b.media.add(tier)
            # G4 events carry the hash only: the request gave the rest.
            parent_hash = ev.parent if ev.tokens else b.parent
            parent = self._held.get(parent_hash) if parent_hash is not None else None
            out.append(BlockStored(
                block_hashes=[b.external], parent_block_hash=parent.external if parent is not None else None,
                token_ids=list(ev.tokens or b.tokens), block_size=self._bs, lora_id=b.lora_id, medium=medium,
                lora_name=b.lora_name, group_idx=0, locality=locality))
        return out

    @property
    def held(self) -> int:
        """Blocks some kvbm tier holds, as announced."""
        return len(self._held)
