"""TensorRT-LLM KV cache events → the KV Event Consolidator's ZMQ input (design §6.2, §7.1).

TensorRT-LLM reports its own (G1) cache events as dicts from
``LLM.get_kv_cache_events()``::

    {"event_id": int, "window_size": int, "attention_dp_rank"?: int,
     "data": {"type": "stored", "parent_hash": int|None,
              "blocks": [{"type": "stored_block", "block_hash": int,
                          "tokens": [{"type": "unique_token", "token_id": int, ...}], ...}]}
           | {"type": "removed", "block_hashes": [int]}
           | {"type": "created", ...} | {"type": "updated", ...}}

:class:`ZmqKvEventPublisher` turns each into one 3-frame ZMQ message
``[topic, seq u64 big-endian, msgpack [ts, [event], attention_dp_rank]]`` with
a map event the consolidator decodes:

* ``stored`` → ``{"type": "BlockStored", "block_hashes": [i64], "parent_block_hash":
  i64|None, "token_ids": [...], "block_size": B, "lora_id": None}``. The chain stops
  at the first partial block (fewer than B tokens; TensorRT-LLM stores the
  prompt's tail as one), whose hash is remembered: routers index full blocks
  only, so that block's later removal is not forwarded either. A block with
  more than B tokens makes the event invalid (logged, dropped).
* ``removed`` → ``{"type": "BlockRemoved", "block_hashes": [i64]}`` without the
  remembered partial blocks.
* ``created`` sets the attention window filter (events of pools with a smaller
  window than the largest are dropped, as Dynamo does); ``updated`` (priority or
  cache-level changes) is not forwarded.

Hashes are TensorRT-LLM's unsigned 64-bit block hashes; values ≥ 2^63 are sent
as their two's-complement i64 (msgpack int64), which the consolidator bit-casts
back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("tensorrt_llm.kvbm")

_U64 = 1 << 64
_I63 = 1 << 63


def to_signed_i64(h: int) -> int:
    """TensorRT-LLM's u64 hash as a signed 64-bit integer (two's complement)."""
    h = int(h)
    if not -_I63 <= h < _U64:
        raise ValueError(f"block hash {h} does not fit in 64 bits")
    return h - _U64 if h >= _I63 else h


class EventTranslator:
    """The stateful part of the publisher: dict events in, map events out."""

    def __init__(self, kv_block_size: int) -> None:
        if int(kv_block_size) < 1:
            raise ValueError(f"kv_block_size={kv_block_size}: must be positive")
        self.block_size = int(kv_block_size)
        self.partial_hashes: set[int] = set()  # signed hashes of partial blocks stored, not forwarded
        self.max_window: int | None = None
        self._last_event_id: int | None = None

    def translate(self, event: dict) -> dict | None:
        """One TensorRT-LLM event dict → one consolidator map event, or None."""
        data = event.get("data") or {}
        kind = data.get("type")
        eid = event.get("event_id")
        if isinstance(eid, int):
            if self._last_event_id is not None and eid != self._last_event_id + 1:
                log.warning("kvbm publisher: TensorRT-LLM event ids jumped from %d to %d (events lost upstream)",
                            self._last_event_id, eid)
            self._last_event_id = eid
        if kind == "created":
            ws = event.get("window_size")
            if isinstance(ws, int):
                self.max_window = ws if self.max_window is None else max(self.max_window, ws)
            return None
        ws = event.get("window_size")
        if self.max_window is not None and isinstance(ws, int) and ws != self.max_window:
            return None  # a pool with a smaller attention window: not what routers index
        if kind == "stored":
            return self._stored(data)
        if kind == "removed":
            return self._removed(data)
        if kind in ("cleared", "all_blocks_cleared"):
            self.partial_hashes.clear()
            return {"type": "AllBlocksCleared"}
        return None  # "updated" and anything unknown

    def _stored(self, data: dict) -> dict | None:
        parent = data.get("parent_hash")
        hashes: list[int] = []
        tokens: list[int] = []
        for blk in data.get("blocks") or ():
            toks = [int(t["token_id"]) if isinstance(t, dict) else int(t) for t in blk.get("tokens") or ()]
            h = to_signed_i64(blk["block_hash"])
            if len(toks) > self.block_size:
                log.error("kvbm publisher: stored block %d has %d tokens, more than kv_block_size=%d; event dropped",
                          h, len(toks), self.block_size)
                return None
            if len(toks) < self.block_size:
                self.partial_hashes.add(h)
                break
            hashes.append(h)
            tokens.extend(toks)
        if not hashes:
            return None
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None if parent is None else to_signed_i64(parent),
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
        }

    def _removed(self, data: dict) -> dict | None:
        out = []
        for h in data.get("block_hashes") or ():
            h = to_signed_i64(h)
            if h in self.partial_hashes:
                self.partial_hashes.discard(h)
                continue
            out.append(h)
        if not out:
            return None
        return {"type": "BlockRemoved", "block_hashes": out}


def default_endpoint() -> str:
    """``tcp://*:{DYN_KVBM_TRTLLM_ZMQ_PORT}``; a ValueError names the variable when it is unset."""
    from kvbm._envs import env_port

    port = env_port("DYN_KVBM_TRTLLM_ZMQ_PORT")
    if port is None:
        raise ValueError("DYN_KVBM_TRTLLM_ZMQ_PORT is not set: it is the port TensorRT-LLM's KV events are "
                         "published on for kvbm's consolidator (e.g. export DYN_KVBM_TRTLLM_ZMQ_PORT=20081)")
    return f"tcp://*:{port}"


class ZmqKvEventPublisher:
    """Publishes TensorRT-LLM KV event dicts to the consolidator (ZMQ PUB, bind).

    ``publish(event_dict)`` returns whether a message was sent. Not thread
    safe: use it from one thread (ZMQ sockets are single-threaded).
    """

    def __init__(self, kv_block_size: int, endpoint: str | None = None, topic: str = "") -> None:
        import zmq

        self._translator = EventTranslator(kv_block_size)
        self.endpoint = endpoint or default_endpoint()
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 1000)
        try:
            self._sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            self._ctx.term()
            raise OSError(f"kvbm publisher: cannot bind {self.endpoint} (DYN_KVBM_TRTLLM_ZMQ_PORT): {e}") from e
        self.seq = 0
        self.sent = 0

    @property
    def partial_hashes(self) -> set[int]:
        return self._translator.partial_hashes

    def publish(self, event: dict) -> bool:
        ev = self._translator.translate(event)
        if ev is None:
            return False
        payload = msgpack.packb([time.time(), [ev], int(event.get("attention_dp_rank", 0) or 0)], use_bin_type=True)
        if self._sock is None:
            raise RuntimeError("kvbm publisher: publish() after close()")
        self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
        self.sent += 1
        return True

    def publish_all(self, events: Iterable[dict]) -> int:
        return sum(1 for ev in events if self.publish(ev))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._ctx.term()
            self._sock = None

    def __enter__(self) -> ZmqKvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KvEventForwarder:
    """Polls ``llm.get_kv_cache_events(timeout)`` on a thread and publishes
    what it returns (needs ``kv_cache_config.event_buffer_max_size > 0``).
    Idle polls back off from 5 ms to 20 ms."""

    def __init__(self, llm: Any, publisher: ZmqKvEventPublisher) -> None:
        self._llm = llm
        self._pub = publisher
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbm-trtllm-events", daemon=True)

    def start(self) -> "KvEventForwarder":
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = 0.005
        while not self._stop.is_set():
            try:
                events = self._llm.get_kv_cache_events(timeout=0) or []
            except Exception as e:  # noqa: BLE001 - keep forwarding
                log.warning("kvbm publisher: get_kv_cache_events failed: %s", e)
                events = []
            if events:
                self._pub.publish_all(events)
                delay = 0.005
            else:
                self._stop.wait(delay)
                delay = min(delay * 1.5, 0.02)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


__all__ = ["EventTranslator", "KvEventForwarder", "ZmqKvEventPublisher", "default_endpoint", "to_signed_i64"]

