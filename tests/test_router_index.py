"""Unit tests of the router-index checker used by the consolidator tests."""

import pytest

from router_index import (
    DUPLICATE_STORE,
    EVENT_ID_GAP,
    MALFORMED,
    REMOVE_UNKNOWN,
    SELF_PARENT,
    STORE_UNKNOWN_PARENT,
    RouterIndex,
    to_u64,
)


def stored(h, parent, tokens, bs=4, lora=None):
    """A consolidated BlockStored as the consolidator writes it."""
    return ["BlockStored", [h], parent, tokens, bs, None, None, lora]


def router_stored(eid, h, parent, tokens_hash=7, worker=1):
    return {"worker_id": worker, "storage_tier": "device",
            "event": {"event_id": eid, "data": {"stored": {"parent_hash": parent,
                      "blocks": [{"block_hash": h, "tokens_hash": tokens_hash}]}}, "dp_rank": 0}}


def router_removed(eid, h, worker=1):
    return {"worker_id": worker, "storage_tier": "device",
            "event": {"event_id": eid, "data": {"removed": {"block_hashes": [h]}}, "dp_rank": 0}}


def router_cleared(eid, worker=1):
    return {"worker_id": worker, "storage_tier": "device",
            "event": {"event_id": eid, "data": "cleared", "dp_rank": 0}}


def test_zmq_chain_store_and_remove_is_consistent():
    idx = RouterIndex()
    idx.apply([1.0, [stored(10, None, [1, 2, 3, 4]), stored(11, 10, [5, 6, 7, 8])], 0])
    assert idx.contains(10) and idx.contains(11)
    assert idx.blocks()[11].parent == 10
    assert idx.blocks()[10].children == {11}
    assert idx.blocks()[11].tokens == (5, 6, 7, 8)
    idx.apply(["BlockRemoved", [11], None])
    idx.apply(["BlockRemoved", [10]])
    assert len(idx) == 0
    idx.assert_consistent()
    assert (idx.stores, idx.removes) == (2, 2)


def test_multi_block_event_chains_inside_the_event():
    idx = RouterIndex()
    idx.apply(["BlockStored", [1, 2, 3], None, list(range(12)), 4, None, "GPU", None])
    assert [idx.blocks()[h].parent for h in (1, 2, 3)] == [None, 1, 2]
    assert idx.blocks()[3].tokens == (8, 9, 10, 11)
    idx.assert_consistent()


def test_map_events_and_map_batches():
    idx = RouterIndex()
    idx.apply({"ts": 1.0, "events": [
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": 5, "token_ids": [3, 4], "block_size": 2},
        {"type": "BlockRemoved", "block_hashes": [6]},
    ], "data_parallel_rank": 0})
    assert idx.contains(5) and not idx.contains(6)
    idx.assert_consistent()


@pytest.mark.parametrize("events, kind", [
    ([stored(11, 10, [1, 2, 3, 4])], STORE_UNKNOWN_PARENT),
    ([["BlockRemoved", [99]]], REMOVE_UNKNOWN),
    ([stored(10, None, [1, 2, 3, 4]), stored(10, None, [1, 2, 3, 4])], DUPLICATE_STORE),
    ([stored(10, 10, [1, 2, 3, 4])], SELF_PARENT),
    ([["BlockStored", [1], None, [1, 2], 0]], MALFORMED),
    ([["BlockUpdated", [1]]], MALFORMED),
    ([["BlockStored", [1.5], None, [1, 2], 2]], MALFORMED),
    ([42], MALFORMED),
])
def test_inconsistencies_are_recorded(events, kind):
    idx = RouterIndex()
    idx.apply_all(events)
    assert idx.kinds() == [kind]
    assert not idx.ok
    with pytest.raises(AssertionError, match=kind):
        idx.assert_consistent()


def test_store_with_unknown_parent_is_not_indexed():
    idx = RouterIndex()
    idx.apply(stored(11, 10, [1, 2, 3, 4]))
    assert not idx.contains(11)
    idx.apply(["BlockRemoved", [11]])
    assert idx.kinds() == [STORE_UNKNOWN_PARENT, REMOVE_UNKNOWN]


def test_clear_forgets_one_worker_only():
    idx = RouterIndex()
    idx.apply(stored(1, None, [1, 2, 3, 4]), worker=0)
    idx.apply(stored(1, None, [1, 2, 3, 4]), worker=1)
    idx.apply(["AllBlocksCleared"], worker=0)
    assert not idx.contains(1, worker=0)
    assert idx.contains(1, worker=1)
    idx.apply(["BlockRemoved", [1]], worker=0)
    assert idx.kinds() == [REMOVE_UNKNOWN]


def test_hash_encodings():
    assert to_u64(-1) == (1 << 64) - 1
    assert to_u64((1 << 63) + 5) == (1 << 63) + 5
    assert to_u64(bytes(range(32))) == 0x18191A1B1C1D1E1F
    idx = RouterIndex()
    idx.apply(["BlockStored", [-2], None, [1, 2], 2])
    idx.apply(["BlockStored", [b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x00\x07"], -2, [3, 4], 2])
    assert idx.blocks()[7].parent == (1 << 64) - 2
    idx.assert_consistent()


def test_router_events_field_by_field():
    idx = RouterIndex()
    idx.apply_all([
        router_stored(0, 100, None, tokens_hash=15310707395893867146),
        router_stored(1, 101, 100),
        router_removed(2, 101),
        router_cleared(3),
        router_stored(4, 100, None),
    ])
    idx.assert_consistent()
    assert idx.blocks(1)[100].tokens_hash == 7
    assert not idx.contains(101, worker=1)
    assert idx.clears == 1


def test_router_multi_block_stored_chains():
    idx = RouterIndex()
    idx.apply({"worker_id": 3, "storage_tier": "device", "event": {"event_id": 0, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 10}, {"block_hash": 2, "tokens_hash": 20}]}},
        "dp_rank": 0}})
    assert idx.blocks(3)[2].parent == 1
    idx.assert_consistent()


def test_router_event_ids_gap_and_redelivery():
    idx = RouterIndex()
    idx.apply(router_stored(0, 1, None))
    idx.apply(router_stored(1, 2, 1))
    idx.apply(router_stored(1, 2, 1))  # redelivered after a reconnect: skipped, not a duplicate store
    assert idx.redelivered == 1
    idx.assert_consistent()
    idx.apply(router_stored(5, 3, 2))  # 2..4 were dropped
    assert idx.kinds() == [EVENT_ID_GAP]
    assert "3 event(s) missing" in str(idx.inconsistencies[0])


def test_router_errors():
    idx = RouterIndex()
    idx.apply(router_removed(0, 9))
    idx.apply(router_stored(1, 5, 4))
    idx.apply({"worker_id": 1, "storage_tier": "device", "event": {"event_id": 2, "data": "wiped", "dp_rank": 0}})
    assert idx.kinds() == [REMOVE_UNKNOWN, STORE_UNKNOWN_PARENT, MALFORMED]


def test_apply_zmq_frames():
    msgpack = pytest.importorskip("msgpack")
    payload = msgpack.packb([1.0, [stored(1, None, [1, 2, 3, 4]), ["BlockRemoved", [1], None]], 0])
    idx = RouterIndex()
    idx.apply_zmq_frames([b"", (0).to_bytes(8, "big"), payload])
    idx.assert_consistent()
    assert (idx.stores, idx.removes) == (1, 1)
    idx.apply_zmq_frames([payload])
    assert idx.kinds() == [MALFORMED]


def test_per_medium_index_tracks_each_tier():
    """vLLM's stream with tiers: one block, stored by the GPU pool and by
    kvbm's host and disk tiers, leaves the index only when the last tier
    removes it; a repeat in one tier and a removal from a tier that does not
    hold the block are reported."""
    def st(h, parent, medium):
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": [1, 2, 3, 4],
                "block_size": 4, "medium": medium}

    def rm(h, medium):
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}

    idx = RouterIndex(per_medium=True)
    idx.apply_all([st(1, None, "GPU"), st(1, None, "CPU"), st(2, 1, "CPU"), st(1, None, "STORAGE")])
    idx.apply_all([rm(1, "GPU"), rm(1, "CPU")])
    idx.assert_consistent()
    assert idx.contains(1) and idx.blocks_in("STORAGE") == {1} and idx.blocks_in("CPU") == {2}
    idx.apply({"type": "AllBlocksCleared"})  # the GPU pool's: kvbm's tiers keep theirs
    assert len(idx) == 2
    idx.apply(rm(1, "STORAGE"))
    assert not idx.contains(1)
    idx.apply_all([st(2, None, "CPU"), rm(1, "CPU"), rm(2, "STORAGE")])
    assert idx.kinds() == [DUPLICATE_STORE, REMOVE_UNKNOWN, REMOVE_UNKNOWN]
