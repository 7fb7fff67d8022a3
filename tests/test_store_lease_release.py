"""A segment a put fills is given back in that put's publish transaction, not in an index
transaction of its own (tier_writes.TierWrites._append): beside vLLM's forward each index
transaction costs GIL takes, and a writer that loses the GIL inside one holds LMDB's
writer lock meanwhile. Values stay readable, and a later put leases another segment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.segment_index import SegmentIndex
from ucm_patch.hooks.stores.tier import record_bytes

SEG = 16 << 10


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The segments given back by SegmentIndex.release (a transaction of its own)."""
    calls: list[int] = []
    real = SegmentIndex.release

    def counted(self: SegmentIndex, seg: int, gen: int, owner: int) -> None:
        calls.append(seg)
        real(self, seg, gen, owner)

    monkeypatch.setattr(SegmentIndex, "release", counted)
    return calls


def _owners(store: LocalStore) -> dict[int, int]:
    return {seg: row.owner for seg, row in store.disk.index.segments().items()}


def test_a_put_that_fills_its_segment_gives_it_back_in_its_publish(
    tmp_path: Path, releases: list[int]
) -> None:
    store = LocalStore(tmp_path / "kv", capacity_bytes=8 * SEG, segment_bytes=SEG)
    try:
        size = 3000
        per_segment = SEG // record_bytes(size)  # from the record layout, not typed in
        assert per_segment >= 2
        values = {f"k{i}": bytes([i]) * size for i in range(per_segment)}
        assert all(store.put_many(list(values.items())))
        owners = _owners(store)
        assert len(owners) == 1 and set(owners.values()) == {0}  # given back: full
        assert releases == []  # in the publish's transaction, not one of its own
        got = store.get_many(list(values))
        assert got == list(values.values())

        # The next put takes another segment; it has room left, so this process keeps it.
        assert store.put_many([("next", b"n" * size)])
        owners = _owners(store)
        assert len(owners) == 2 and sorted(owners.values()) == [0, os.getpid()]
        assert store.get_many(["next"]) == [b"n" * size]
    finally:
        store.close()


def test_a_put_across_segments_gives_each_full_one_back_as_it_goes(
    tmp_path: Path, releases: list[int]
) -> None:
    store = LocalStore(tmp_path / "kv", capacity_bytes=8 * SEG, segment_bytes=SEG)
    try:
        size = 3000
        per_segment = SEG // record_bytes(size)
        n = 2 * per_segment + 1  # two full segments and one record into a third
        items = [(f"k{i}", bytes([i % 251]) * size) for i in range(n)]
        assert all(store.put_many(items))
        owners = _owners(store)
        assert sorted(owners.values()) == [0, 0, os.getpid()]
        assert releases == []
        assert store.get_many([k for k, _v in items]) == [v for _k, v in items]
    finally:
        store.close()
