"""A spilling tier's put from a thread beside the forward (hooks/stores/tier_beside_writes.py):
however many segments a put spans, one native call that copies every value and sends the
request for its publishes (plus one request for its leases when the process keeps none),
nothing of the index done in the writer's process, every value readable; a dry reserve
skips, never waits; without the native helper the same put is copied part by part; a
request the native call could not send whole is published by the writer."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from xxhash import xxh3_128_digest

from tests.support.serving_store import SEG, VALUE, open_store, serving, value, wait_serving
from ucm_patch.hooks.stores import rowcopy, segment_files, tier_beside_writes
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import key_bytes
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.publish_channel import PublishChannels, PublishClient, beside_forward
from ucm_patch.hooks.stores.segment_index import SegmentIndex
from ucm_patch.hooks.stores.tier import Tier, record_bytes


def _records(keys: Sequence[str]) -> list[tuple[bytes, bytes, memoryview]]:
    return [(xxh3_128_digest(key_bytes(k)), key_bytes(k), memoryview(value(k))) for k in keys]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    s = open_store(tmp_path)
    yield s
    s.close()


def _serving(s: LocalStore) -> tuple[Tier, PublishChannels]:
    """The memory tier, and its channels serving (a lease kept from the put that
    started its cleaner)."""
    channels = serving(s)
    assert s.memory is not None
    return s.memory, channels


def _beside(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread marked as one beside a forward (a dump worker)."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        beside_forward()
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the test's thread
            failed.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return out[0]


def _in_process_index_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Index calls made by threads of this process beside a forward."""
    calls: list[str] = []
    for name in ("publish", "claim", "segments", "release"):
        real = getattr(SegmentIndex, name)

        def counted(self: SegmentIndex, *a: object, _real=real, _name=name, **k: object):
            if threading.current_thread() is not threading.main_thread():
                calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(SegmentIndex, name, counted)
    return calls


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each native copy call of the beside-forward path: ("send", values) for one that
    also sends the publish request, ("copy", values) for one that copies only."""
    calls: list[tuple[str, int]] = []
    copy, send = tier_beside_writes.copy_framed_many, tier_beside_writes.copy_framed_send

    def copied(entries: Sequence[Any], secret: bytes | None = None) -> Any:
        calls.append(("copy", len(entries)))
        return copy(entries, secret)

    def sent(entries: Sequence[Any], *args: Any) -> Any:
        calls.append(("send", len(entries)))
        return send(entries, *args)

    monkeypatch.setattr(tier_beside_writes, "copy_framed_many", copied)
    monkeypatch.setattr(tier_beside_writes, "copy_framed_send", sent)
    return calls


def _python_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The requests written by Python (not inside a native copy call): their bytes."""
    calls: list[int] = []
    real = PublishClient._send

    def counted(self: PublishClient, data: bytes) -> None:
        calls.append(len(data))
        real(self, data)

    monkeypatch.setattr(PublishClient, "_send", counted)
    return calls


def test_a_put_spanning_segments_is_one_copy_and_two_requests(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory, client = _serving(store)
    index_calls = _in_process_index_calls(monkeypatch)
    copies = _copies(monkeypatch)
    python_sends = _python_sends(monkeypatch)
    per_segment = SEG // record_bytes(VALUE)  # from the record layout
    keys = [f"k{i}" for i in range(2 * per_segment + per_segment // 2)]
    sent = client.sent
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in keys])))
    # every value in one native call, which also sent the publishes: the thread takes the
    # GIL back once for both
    assert copies == [("send", len(keys))]
    # the lease kept from "start" had room for a segment less one value: one request for
    # the two more segments this put needs (from Python), and one for its three publishes
    assert client.sent - sent == 2 and len(python_sends) == 1
    assert index_calls == []
    assert store.get_many(keys) == [value(k) for k in keys]
    rows = memory.index.segments()
    mine = sorted(seg for seg, row in rows.items() if row.owner == os.getpid())
    # the two segments filled were given back in their publishes; the last one is kept,
    # with room for a put like this one asked for in the same request (at most
    # spare_segments of the tier's reserve)
    full = [seg for seg, row in rows.items() if row.end + record_bytes(VALUE) > SEG]
    assert len(full) == 2 and not set(full) & set(mine)
    wrote = len(keys) * record_bytes(VALUE)
    last_room = SEG - rows[max(mine, key=lambda seg: rows[seg].end)].end
    most = tier_beside_writes.spare_segments(memory.reserve)
    spare = min(most, -(-(wrote - last_room) // SEG))
    assert len(mine) == 1 + spare and memory.holds_kept_lease()
    # the next puts start in the kept leases: one request each, however they fall
    sent = client.sent
    more = [f"m{i}" for i in range(per_segment)]
    for i in range(0, len(more), 4):
        chunk = more[i : i + 4]
        assert all(_beside(lambda c=chunk: store.put_many([(k, value(k)) for k in c])))
    assert client.sent - sent == -(-len(more) // 4) and len(python_sends) == 1
    assert copies[1:] == [("send", len(more[i : i + 4])) for i in range(0, len(more), 4)]
    assert index_calls == []
    assert store.get_many(more) == [value(k) for k in more]


def test_a_dry_reserve_skips_the_values_with_no_room(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every segment the put could take is leased by another live process: the values
    that fit the kept lease are stored, the rest answer False at once, counted."""
    memory, _client = _serving(store)
    other = os.getppid()  # alive for the test's whole run
    rows = memory.index.segments()
    for seg in range(memory.count):
        row = rows.get(seg)
        if row is None or row.owner == 0:
            assert memory.index.claim(seg, row, other, empty=row is None) is not None
    room = SEG - next(row.end for row in memory.index.segments().values()
                      if row.owner == os.getpid())  # fmt: skip
    fits = room // record_bytes(VALUE)
    keys = [f"d{i}" for i in range(fits + 3)]
    dry = memory.reserve_dry
    t = time.perf_counter()
    got = _beside(lambda: memory.put(_records(keys)))
    assert time.perf_counter() - t < 1.0  # no wait for a spill or a cleaner
    assert got == [True] * fits + [False] * 3
    assert memory.reserve_dry > dry
    assert store.get_many(keys[:fits]) == [value(k) for k in keys[:fits]]


def test_without_the_native_helper_the_put_is_copied_part_by_part(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _memory, client = _serving(store)
    monkeypatch.setattr(rowcopy, "_helper", None)
    monkeypatch.setattr(rowcopy, "_tried", True)  # as on a host with no C compiler
    per_segment = SEG // record_bytes(VALUE)
    keys = [f"p{i}" for i in range(2 * per_segment)]
    sent = client.sent
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in keys])))
    assert client.sent - sent == 2  # still one request for the leases, one to publish
    assert store.get_many(keys) == [value(k) for k in keys]


def test_prepare_writes_starts_the_channel_before_any_put(store: LocalStore) -> None:
    """A worker that dumps starts its store's cleaner process at start: its first dumps
    find the channel serving, not a process still starting."""
    memory = store.memory
    assert memory is not None
    assert memory.cleaner.publisher is None  # nothing put, nothing started
    store.prepare_writes()
    channels = memory.cleaner.publishers
    assert channels is not None
    wait_serving(channels)
    assert store.stats["puts"] == 0


def test_a_request_not_sent_whole_is_published_by_the_writer(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native call copied every value but could not write the request (the pipe
    refused it): the channel is given up (a request cut short would make its stream
    unreadable), the writer publishes the put itself, every value is readable, and the
    next puts go the usual way."""
    _memory, channels = _serving(store)
    index_calls = _in_process_index_calls(monkeypatch)
    real = tier_beside_writes.copy_framed_send

    def refused(entries: Sequence[Any], request: bytes, _request_fd: int, *rest: Any) -> Any:
        return real(entries, request, -1, *rest)  # EBADF: nothing of the request written

    monkeypatch.setattr(tier_beside_writes, "copy_framed_send", refused)
    keys = [f"cut{i}" for i in range(3)]
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in keys])))
    client = channels.clients[0]
    assert client.broken
    assert "publish" in index_calls  # done here
    assert store.get_many(keys) == [value(k) for k in keys]
    later = [f"later{i}" for i in range(3)]
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in later])))
    assert store.get_many(later) == [value(k) for k in later]


def test_a_large_tier_keeps_room_for_a_put_of_several_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a tier whose reserve is large, a put that spans several segments keeps leases
    with room for a put like it (up to half the reserve), so that the next one, alike,
    sends one request (its publishes) and none for leases: beside the forward, each
    request's answer is a GIL take. A tier with a small reserve keeps SPARE_SEGMENTS."""
    big = LocalStore(
        tmp_path / "kv", capacity_bytes=256 * SEG, memory_bytes=64 * SEG,
        memory_path=tmp_path / "shm", segment_bytes=SEG,
    )  # fmt: skip
    try:
        memory, client = _serving(big)
        most = tier_beside_writes.spare_segments(memory.reserve)
        assert tier_beside_writes.SPARE_SEGMENTS < most <= memory.reserve // 2
        per_segment = SEG // record_bytes(VALUE)
        n = (most - 1) * per_segment + per_segment // 2  # spans ``most`` segments
        python_sends = _python_sends(monkeypatch)
        for round_ in range(3):
            keys = [f"r{round_}/{i}" for i in range(n)]
            sent = client.sent
            assert all(_beside(lambda k=keys: big.put_many([(x, value(x)) for x in k])))
            if round_:  # kept by the put before: its publishes only, sent natively
                assert client.sent - sent == 1, f"round {round_}: {client.sent - sent} requests"
            assert big.get_many(keys) == [value(k) for k in keys]
        assert python_sends[1:] == []  # after the first put's lease request, none
    finally:
        big.close()
    for reserve in range(64):
        keep = tier_beside_writes.spare_segments(reserve)
        assert keep == max(tier_beside_writes.SPARE_SEGMENTS, reserve // 2)


def test_a_put_checks_its_segments_files_without_giving_the_gil_up(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory tier's segment files are checked once per put (deleted or cut short
    behind the store), by an ``fstat`` that keeps the GIL (rowcopy.fstat_held):
    ``os.fstat`` gives it up, and beside the forward each give-up of a dump thread costs
    a take back, up to the switch interval, before its copy starts (a file cut short
    behind the store is still found: tests/test_store_segment_cut_short.py)."""
    memory, _channels = _serving(store)
    per_segment = SEG // record_bytes(VALUE)
    warm = [f"w{i}" for i in range(2 * per_segment)]  # every segment this test uses opened
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in warm])))
    released: list[int] = []
    held: list[int] = []
    opened = set(memory.files._fds.values())
    real_os, real_held = os.fstat, rowcopy.fstat_held
    monkeypatch.setattr(segment_files.os, "fstat", lambda fd: released.append(fd) or real_os(fd))
    monkeypatch.setattr(segment_files, "fstat_held",
                        lambda fd: held.append(fd) or real_held(fd))  # fmt: skip
    keys = [f"k{i}" for i in range(per_segment + per_segment // 2)]  # two segments or more
    assert all(_beside(lambda: store.put_many([(k, value(k)) for k in keys])))
    # os.fstat only for a file opened by this put (once per file and process)
    assert not set(released) & opened and len(set(held)) >= 2
    assert store.get_many(keys) == [value(k) for k in keys]


def test_a_put_placed_past_its_part_copies_nothing(store: LocalStore) -> None:
    """The native copy writes by address: every record's place is checked against its
    part's end and its mapping before the call (a copy past a mapping would write into
    whatever memory follows it). A part that ends before its records raises StoreError,
    and nothing was copied."""
    memory, _channels = _serving(store)
    records = _records([f"p{i}" for i in range(3)])
    sizes = [record_bytes(len(r[2])) for r in records]

    def place() -> None:
        lease = memory._take_kept()
        assert lease is not None
        try:
            parts = tier_beside_writes._plan([lease], sizes, memory.segment_bytes)
            parts[0].end -= sizes[-1]  # the last record now ends past its part
            before = bytes(
                memory.files.mapping(lease.seg, SEG, write=True)[lease.end : parts[0].end]
            )
            with pytest.raises(StoreError, match=r"records of segment \d+ end at \d+, past"):
                memory._send_plan(records, [0, 1, 2], parts)
            after = bytes(
                memory.files.mapping(lease.seg, SEG, write=True)[lease.end : parts[0].end]
            )
            assert before == after
        finally:
            memory._keep(lease, sizes[0])

    _beside(place)


def test_fstat_held_answers_what_a_segment_check_reads(tmp_path: Path) -> None:
    """A file's size as ``os.fstat``'s, and whether it is linked (a second link
    included); 0 links once removed (a segment deleted behind the store); a bad
    descriptor raises OSError naming it."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(12345))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = rowcopy.fstat_held(fd)
        assert (got.st_size, got.st_nlink) == (12345, 1) == (os.fstat(fd).st_size, 1)
        os.link(path, tmp_path / "g")
        assert rowcopy.fstat_held(fd).st_nlink >= 1 and os.fstat(fd).st_nlink == 2
        path.unlink()
        (tmp_path / "g").unlink()
        assert os.fstat(fd).st_nlink == 0 and rowcopy.fstat_held(fd).st_nlink == 0
    finally:
        os.close(fd)
    with pytest.raises(OSError, match=f"fd {fd}"):
        rowcopy.fstat_held(fd)
    helper = rowcopy._get()
    assert helper is not None
    # loaded through PyDLL: the call keeps the GIL (a CDLL function gives it up)
    assert helper.fstat_held._flags_ & ctypes._FUNCFLAG_PYTHONAPI


def test_frame_send_refuses_columns_of_several_lengths() -> None:
    """A column shorter or of another width than the others is refused, naming it,
    before the helper reads any of them."""
    src = memoryview(bytearray(os.urandom(4096)))
    dst = memoryview(bytearray(4096))
    head = memoryview(bytearray(8))
    planned = rowcopy.send_columns([(dst, src, b"material", head, b"lead")])
    assert planned is not None
    cols, head_len = planned
    short = cols._replace(size=array(rowcopy.WORD))
    with pytest.raises(ValueError, match="column size has 0 entries"):
        rowcopy.frame_send(short, head_len, -1, b"", -1, 0.0)
    narrow = cols._replace(seed_len=array("b", [8]))
    with pytest.raises(ValueError, match="column seed_len has 1 entries of 'b'"):
        rowcopy.frame_send(narrow, head_len, -1, b"", -1, 0.0)
    assert dst == bytes(4096)  # nothing copied


def test_a_put_whose_placement_fails_gives_its_leases_back(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A placement that fails before the copy (records past their part, a mapping lost)
    raises, and the leases the put held are given back, not kept leased by a process
    that will never write them."""
    memory, _channels = _serving(store)
    per_segment = SEG // record_bytes(VALUE)
    keys = [f"k{i}" for i in range(per_segment + per_segment // 2)]  # two segments
    mine = {seg for seg, row in memory.index.segments().items() if row.owner == os.getpid()}

    def lost(*_a: object) -> None:
        raise StoreError("memory tier: records of segment 0 end at 1, past its part")

    monkeypatch.setattr(tier_beside_writes.TierBesideWrites, "_placed", lost)
    with pytest.raises(StoreError, match="past its part"):
        _beside(lambda: store.put_many([(k, value(k)) for k in keys]))
    after = {seg for seg, row in memory.index.segments().items() if row.owner == os.getpid()}
    assert not after - mine and not memory.holds_kept_lease()
