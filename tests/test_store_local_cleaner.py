"""The memory tier's cleaner: no put spills or waits for a disk write, a writer keeps its
segment between puts, and nothing stored is lost when a writer or its cleaner is killed.

The cleaner is a process of its own (hooks/stores/segment_cleaner.py). Stalling it with
SIGSTOP stands for a disk slower than the puts: the reserve runs dry, and puts must still
return at once, never wait for a spill: their values go around the memory tier into the
disk tier's page cache while the kernel lets pages be dirtied without pausing the writer,
and are skipped and counted past that line (or when the disk tier fsyncs).
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores import segment_cleaner, segment_files
from ucm_patch.hooks.stores import tier_leases as tier_module
from ucm_patch.hooks.stores.cleaner_process import SPILL_WRITE_NICE, SpillThread, SpillWriter
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.segment_cleaner import SegmentCleaner
from ucm_patch.hooks.stores.segment_index import SegmentIndex, pid_alive
from ucm_patch.hooks.stores.tier import Tier, record_bytes

SEG = 64 << 10
VALUE = 8 << 10
PER_SEG = SEG // record_bytes(VALUE)


def value_of(key: str) -> bytes:
    return hashlib.blake2b(key.encode()).digest() * (VALUE // 64)


def _store(root: Path, disk_segments: int = 64) -> LocalStore:
    return LocalStore(
        root / "kv", capacity_bytes=disk_segments * SEG, memory_bytes=8 * SEG,
        memory_path=root / "shm", segment_bytes=SEG,
    )  # fmt: skip


def _put_driven(store: LocalStore, keys: list[str], before: Callable[[], None] | None = None
                ) -> None:  # fmt: skip
    """Put each key, the cleaner driven here: a put the store did not take is put again
    after one refill (``refill_two``); ``before`` runs ahead of each key's put."""
    assert store.memory is not None
    refills = 0
    for k in keys:
        if before is not None:
            before()
        while store.put_many([(k, value_of(k))]) != [True]:
            segment_cleaner.refill_two(store.memory, store.disk)
            refills += 1
            assert refills < 100 * len(keys), "the store never took the put"


def _ranges(indexes: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9``."""
    out: list[str] = []
    for i in indexes:
        if out and int(out[-1].rsplit("-", 1)[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _newest_readable(store: LocalStore, keys: list[str], put_again: Sequence[int] = ()
                     ) -> list[int]:  # fmt: skip
    """The indexes of ``keys`` readable, each with its own value, asserted to be the newest
    ones in put order (a suffix): a newer value was never lost before an older one. On a
    failure, what the store did (its counters, the puts it answered False) is said with
    the values lost: this has failed once in CI and never here."""
    got = store.get_many(keys)
    readable = [i for i, v in enumerate(got) if v is not None]
    assert all(got[i] == value_of(keys[i]) for i in readable)
    lost = sorted(set(range(readable[0], len(keys))) - set(readable))
    assert not lost, (
        f"a newer value was lost: {_ranges(lost)} of {readable[0]}-{len(keys) - 1} "
        f"(PER_SEG {PER_SEG}); puts answered False and put again: {_ranges(list(put_again))}; "
        f"store counters {dict(store.stats)}"
    )
    return readable


def _put_all(store: LocalStore, keys: list[str]) -> list[int]:
    """Put each key; a put the reserve had no segment for (False) is put again once the
    cleaner has refilled it: what a caller that must store everything does. The indexes
    of the keys put again."""
    assert store.memory is not None
    again: list[int] = []
    for i, k in enumerate(keys):
        while store.put_many([(k, value_of(k))]) != [True]:
            again.append(i)
            assert store.memory.cleaner.wait_idle(60)
    return again


def _stop_cleaner(s: LocalStore) -> int:
    """Put one value (its cleaner starts), then stop the cleaner (SIGSTOP: a disk that
    takes nothing): its pid, for SIGCONT."""
    assert s.memory is not None
    _put_all(s, ["first"])
    pid = s.memory.cleaner.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_no_put_spills_in_the_putting_process(tmp_path: Path, monkeypatch) -> None:
    """Values leave the full memory tier for the disk tier, and not one spill ran in the
    process that puts: the cleaner process did them all (before, the put that needed a
    segment spilled a whole one on its own thread)."""
    spills: list[str] = []
    real = Tier._spill

    def spy(self: Tier, seg: int, live: list) -> tuple[int, int]:  # type: ignore[type-arg]
        spills.append(threading.current_thread().name)
        return real(self, seg, live)

    monkeypatch.setattr(Tier, "_spill", spy)
    s = _store(tmp_path)
    keys = [f"k{i}" for i in range(5 * 8 * PER_SEG)]  # five times the memory tier
    _put_all(s, keys)
    assert s.memory is not None and s.memory.cleaner.pid is not None
    assert spills == [], f"spilled in the putting process, on {set(spills)}"
    # each value past the memory tier's size left it by a spill (counted by the cleaner)
    # or went around it (the reserve was dry)
    assert s.stats["spilled"] + s.stats["written_around"] >= len(keys) - 8 * PER_SEG
    assert s.get_many(keys) == [value_of(k) for k in keys]
    assert s.stats["evictions"] == 0 and s.stats["corrupt"] == 0
    s.close()


def _no_dirty_room(s: LocalStore, monkeypatch) -> None:
    """The host's dirty pages past the kernel's free-run line: no put may go around."""
    monkeypatch.setattr(s._dirty, "room", lambda: False)


def test_a_dry_reserve_writes_around_the_memory_tier_at_once(tmp_path: Path, monkeypatch) -> None:
    """The cleaner stopped: once the memory tier is full, puts still answer True at once,
    their values written around it into the disk tier (one copy, never a spill on the
    put's thread), counted in written_around and readable from the disk tier; what the
    memory tier held is untouched. A store that fsyncs its disk tier never writes around
    (the put would wait for the disk): there, the same puts are skipped. (The host's
    dirty pages are taken as below the line here: the gauge has tests of its own.)"""
    s = _store(tmp_path)
    monkeypatch.setattr(s._dirty, "room", lambda: True)
    pid = _stop_cleaner(s)
    keys = [f"a{i}" for i in range(3 * 8 * PER_SEG)]
    try:
        started = time.monotonic()
        answers = [s.put_many([(k, value_of(k))]) for k in keys]
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answers == [[True]] * len(keys), "a put was skipped with room for dirty pages"
    assert took < 30, f"the puts took {took:.1f} s"
    around = s.stats["written_around"]
    assert around >= len(keys) - 8 * PER_SEG and s.stats["reserve_dry"] >= 1
    assert s.stats["skipped_full"] == 0 and s.stats["spilled"] == 0
    tiers = [p.tier for p in map(s.where, keys) if p is not None]
    assert len(tiers) == len(keys) and tiers.count("disk") == around, tiers
    assert s.get_many(keys) == [value_of(k) for k in keys]
    s.close()

    synced = LocalStore(
        tmp_path / "kv-fsync", capacity_bytes=64 * SEG, memory_bytes=8 * SEG,
        memory_path=tmp_path / "shm-fsync", segment_bytes=SEG, fsync=True,
    )  # fmt: skip
    monkeypatch.setattr(synced._dirty, "room", lambda: True)
    pid = _stop_cleaner(synced)
    try:
        answers = [synced.put_many([(k, value_of(k))]) for k in keys]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [False] in answers and synced.stats["written_around"] == 0
    assert synced.stats["skipped_full"] == answers.count([False])
    synced.close()


def test_a_dry_reserve_skips_at_once_and_never_waits(tmp_path: Path, monkeypatch) -> None:
    """The cleaner stopped (SIGSTOP: a disk that takes nothing) and the host's dirty pages
    past the free-run line: once the memory tier is full, puts answer False at once,
    counted in skipped_full and reserve_dry, and return while the cleaner is still
    stopped. Let go, it refills the reserve and puts store again; every value answered
    True is readable."""
    s = _store(tmp_path)
    _no_dirty_room(s, monkeypatch)
    pid = _stop_cleaner(s)
    answers: dict[str, bool] = {}

    def put_many_values() -> None:
        for i in range(3 * 8 * PER_SEG):
            k = f"v{i}"
            answers[k] = s.put_many([(k, value_of(k))]) == [True]

    try:
        putter = threading.Thread(target=put_many_values)
        putter.start()
        putter.join(60)
        assert not putter.is_alive(), "a put waited for the stopped cleaner"
    finally:
        os.kill(pid, signal.SIGCONT)
    skipped = [k for k, ok in answers.items() if not ok]
    assert skipped, "the memory tier never ran dry"
    assert s.stats["skipped_full"] == len(skipped) and s.stats["reserve_dry"] >= 1
    stored = [k for k, ok in answers.items() if ok]
    assert len(stored) <= 8 * PER_SEG  # nothing went anywhere but the memory tier
    assert s.get_many(stored) == [value_of(k) for k in stored]
    assert s.memory.cleaner.wait_idle(60)
    _put_all(s, ["after"])
    assert s.get_many(["after", *stored]) == [value_of(k) for k in ["after", *stored]]
    s.close()


def test_a_dry_reserve_is_answered_without_reading_the_index(tmp_path: Path, monkeypatch) -> None:
    """Once a put found the reserve dry, the next puts answer False (counted) without a
    look at the segment table, until a cleaner has spilled again: with N writers on a
    full store, a scan per skipped put only took CPU from the spills that refill it.
    After a spill (the tier's shared counts change) a put reads the index again."""
    monkeypatch.setattr(tier_module, "DRY_RECHECK_S", 600.0)  # only a spill ends it here
    s = _store(tmp_path)
    _no_dirty_room(s, monkeypatch)
    pid = _stop_cleaner(s)
    try:
        i = 0
        while s.put_many([(f"d{i}", value_of(f"d{i}"))]) == [True]:
            i += 1
            assert i < 16 * PER_SEG, "the memory tier never ran dry"
        scans = []
        real = s.memory.index.segments
        monkeypatch.setattr(s.memory.index, "segments", lambda: scans.append(1) or real())
        dry = s.stats["reserve_dry"]
        answers = [s.put_many([(f"e{j}", value_of(f"e{j}"))]) for j in range(50)]
        assert answers == [[False]] * 50 and s.stats["reserve_dry"] == dry + 50
        assert scans == [], f"{len(scans)} scans of the segment table while dry"
        s.memory._count_shared(1, 0)  # as a cleaner's spill does
        assert s.put_many([("again", value_of("again"))]) == [False]
        assert scans, "a spill since did not send the put back to the index"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert s.memory.cleaner.wait_idle(60)
    _put_all(s, ["after"])
    assert s.get_many(["after"]) == [value_of("after")]
    s.close()


def test_a_spill_is_counted_once_its_segment_is_ready(tmp_path: Path, monkeypatch) -> None:
    """Writers read a change of the shared spill counts as "a segment is ready"
    (test above), so the cleaner counts a spill only once the emptied segment is given
    back: at that moment the reserve already holds it."""
    monkeypatch.setattr(SegmentCleaner, "ensure_started", lambda self: None)  # driven here
    monkeypatch.setattr(SegmentCleaner, "wake", lambda self: None)
    s = _store(tmp_path)
    _no_dirty_room(s, monkeypatch)
    memory = s.memory
    assert memory is not None
    i = 0
    while s.put_many([(f"c{i}", value_of(f"c{i}"))]) == [True]:
        i += 1
        assert i < 16 * PER_SEG, "the memory tier never ran dry"
    memory.release_idle_leases(0)
    seen: list[tuple[int, int]] = []
    real = memory._count_shared

    def counted(spilled: int, dropped: int) -> None:
        seen.append((memory.reserve_state()[0], spilled))
        real(spilled, dropped)

    monkeypatch.setattr(memory, "_count_shared", counted)
    before = memory.reserve_state()[0]
    assert memory.empty_one_for_reserve()
    assert seen == [(before + 1, PER_SEG)], f"ready segments when counted: {seen}, {before=}"
    assert s.put_many([("next", value_of("next"))]) == [True]
    s.close()


class _FakeTier:
    """What refill_two reads and does: the reserve's state and the segments it empties."""

    count = 64

    def __init__(self, reserve: int, ready: int, victims: list[int]) -> None:
        self.reserve, self.ready = reserve, ready
        self.victims = [(tick, seg, None) for seg, tick in enumerate(victims)]
        self.emptied: list[tuple[int, bool]] = []

    def reserve_state(self) -> tuple[int, list]:  # type: ignore[type-arg]
        return self.ready, sorted(self.victims)

    def empty_segment(self, victim: tuple, drop: bool = False) -> bool:  # type: ignore[type-arg]
        self.victims.remove(victim)
        self.ready += 1
        self.emptied.append((victim[0], drop))
        return True


def test_the_cleaner_empties_the_stores_oldest_segment_whichever_tier_holds_it() -> None:
    """One recency order over both tiers (segment_cleaner.refill_two): the memory tier's
    oldest segment is spilled while the disk has room beyond its reserve, and once the
    disk is full only when it is newer than the disk's oldest (which the spill evicts);
    older, it is dropped. The disk's reserve is refilled by dropping its oldest segment,
    after every memory segment older than that one."""
    around = 2  # the disk tier's reserve here
    # the disk has room: the memory tier's oldest is spilled, never dropped
    memory, disk = _FakeTier(2, 0, [10, 20, 30]), _FakeTier(0, around + 5, [])
    segment_cleaner.refill_two(memory, disk, disk_reserve=around)
    assert memory.emptied == [(10, False), (20, False)] and disk.emptied == []
    # the disk full, its oldest newer than the memory's oldest: dropped, not spilled
    memory, disk = _FakeTier(2, 0, [10, 20, 50]), _FakeTier(0, around, [15, 40])
    segment_cleaner.refill_two(memory, disk, disk_reserve=around)
    assert memory.emptied == [(10, True), (20, False)], memory.emptied
    assert disk.emptied == []
    # the disk's reserve short: memory segments older than the disk's oldest go first
    memory, disk = _FakeTier(1, 1, [5, 6, 90]), _FakeTier(0, 0, [7, 8, 9])
    segment_cleaner.refill_two(memory, disk, disk_reserve=around)
    assert memory.emptied == [(5, True), (6, True)], memory.emptied
    assert disk.emptied == [(7, True), (8, True)], disk.emptied
    # the disk's reserve short with nothing of its own to empty (every segment a live
    # writer's): memory segments are not dropped for it, which would not refill it
    memory, disk = _FakeTier(1, 1, [1, 2, 3]), _FakeTier(0, 0, [])
    segment_cleaner.refill_two(memory, disk, disk_reserve=around)
    assert memory.emptied == [] and disk.emptied == []
    # both reserves full: nothing emptied
    memory, disk = _FakeTier(1, 1, [1]), _FakeTier(0, around, [2])
    segment_cleaner.refill_two(memory, disk, disk_reserve=around)
    assert memory.emptied == [] and disk.emptied == []
    # by default, the reserve a disk tier of its size keeps: an eighth, at most 16
    assert [segment_cleaner.around_reserve(n) for n in (8, 64, 1000)] == [2, 8, 16]


def test_while_a_spill_runs_the_cleaner_keeps_the_disk_reserve_full() -> None:
    """Spills started on the cleaner process's spill thread (``start_spill``): refill_two
    starts one, and while it runs, returns with work left instead of waiting, after
    refilling the disk tier's reserve by drops (which puts written around a dry memory
    tier take from); a memory segment older than the disk's oldest is still dropped
    first. Once the spill is done, the next call starts the next one."""
    around = 2
    memory, disk = _FakeTier(2, 0, [40, 50, 60]), _FakeTier(0, around, [10, 20, 30])
    started: list[int] = []
    running = [False]

    def start(victim: tuple) -> bool:  # type: ignore[type-arg]
        if running[0]:
            return False
        running[0] = True
        memory.victims.remove(victim)  # claimed by the spill: no longer a victim
        started.append(victim[0])
        return True

    # the memory tier short, its oldest newer than the disk's oldest: a spill starts
    assert segment_cleaner.refill_two(memory, disk, None, around, True, start) is True
    assert started == [40] and memory.emptied == [] and disk.emptied == []
    # it runs; writers took the disk's reserve: refilled by drops, oldest first, no wait
    disk.ready = 0
    assert segment_cleaner.refill_two(memory, disk, None, around, True, start) is True
    assert disk.emptied == [(10, True), (20, True)] and started == [40]
    # a memory segment older than the disk's oldest: dropped, even while a spill runs;
    # with the disk at its reserve, the next oldest is dropped too (the recency order)
    memory.victims.append((5, 9, None))
    disk.ready = 0
    segment_cleaner.refill_two(memory, disk, None, around, True, start)
    assert memory.emptied == [(5, True), (50, True)] and disk.emptied[-1] == (30, True)
    assert started == [40], "a second spill started beside the first"
    # the same told which segment is being spilled (the cleaner process's spill thread):
    # nothing used after it is emptied until it ends, in either tier
    memory, disk = _FakeTier(2, 0, [5, 50, 60]), _FakeTier(0, 0, [10, 20, 30, 45])
    memory.victims = [v for v in memory.victims if v[0] != 40]
    assert segment_cleaner.refill_two(memory, disk, None, around, True, start, lambda: 40)
    assert memory.emptied == [(5, True)], memory.emptied
    assert disk.emptied == [(10, True), (20, True)], disk.emptied
    disk.ready = 0
    assert segment_cleaner.refill_two(memory, disk, None, around, True, start, lambda: 40)
    assert disk.emptied[2:] == [(30, True)] and memory.emptied == [(5, True)]
    assert segment_cleaner.refill_two(memory, disk, None, around, True, start, lambda: 40)
    assert len(disk.emptied) == 3 and memory.emptied == [(5, True)], "45 or 50 went before 40"
    running[0] = False
    started.clear()
    # the spill done: the next one starts
    memory, disk = _FakeTier(2, 0, [60]), _FakeTier(0, around, [45])
    segment_cleaner.refill_two(memory, disk, None, around, True, start)
    assert started == [60], started


def test_the_spill_thread_runs_one_spill_at_a_time_and_close_waits_for_it() -> None:
    """SpillThread: a spill runs on its own thread (the cleaner's keeps going); a second
    is refused while one runs; an error is logged, not raised into the cleaner's loop;
    close waits for the running spill (its segment is never left half spilled)."""

    class Memory:
        path = "memory"

        def __init__(self) -> None:
            self.go, self.done, self.threads = threading.Event(), [], []

        def empty_segment(self, victim: tuple) -> bool:  # type: ignore[type-arg]
            self.threads.append(threading.get_ident())
            assert self.go.wait(30)
            if victim[1] < 0:
                raise OSError(5, "broken disk")
            self.done.append(victim[1])
            return True

    warned: list[str] = []

    class Warn:
        def warning(self, key: str, *args: object) -> None:
            warned.append(key)

    memory = Memory()
    spills = SpillThread(memory, Warn())  # type: ignore[arg-type]
    assert spills.start((1, 7, None)) is True
    assert spills.start((2, 8, None)) is False, "a second spill started beside the first"
    memory.go.set()
    deadline = time.monotonic() + 30
    while not spills.start((3, -1, None)):
        assert time.monotonic() < deadline, "the first spill never ended"
        time.sleep(0.001)
    spills.close()
    assert memory.done == [7] and warned == ["spill"]
    assert threading.get_ident() not in memory.threads


def test_recency_holds_across_tiers_with_puts_written_around(tmp_path: Path, monkeypatch) -> None:
    """A full store whose cleaner falls behind (driven here, one refill per skipped put):
    puts go around the dry memory tier into the disk tier, the cleaner drops memory
    segments older than the disk's oldest instead of spilling them, and the readable
    keys are still exactly the newest ones, in put order."""
    monkeypatch.setattr(SegmentCleaner, "ensure_started", lambda self: None)  # driven here
    monkeypatch.setattr(SegmentCleaner, "wake", lambda self: None)
    s = _store(tmp_path, disk_segments=16)
    monkeypatch.setattr(s._dirty, "room", lambda: True)
    assert s.memory is not None
    keys = [f"w{i}" for i in range(12 * 8 * PER_SEG)]
    _put_driven(s, keys)
    readable = _newest_readable(s, keys)
    assert len(readable) > 8 * PER_SEG
    assert s.stats["written_around"] > 0 and s.stats["spilled"] > 0
    assert s.memory.evictions > 0, "no memory segment was dropped for being the oldest"
    s.close()


def test_recency_holds_when_puts_switch_tiers_mid_segment(tmp_path: Path, monkeypatch) -> None:
    """Puts go around the memory tier and back while segments of both tiers still have
    room (the host's dirty pages cross the kernel's line and back): the segment left in
    either tier is not appended to again (:meth:`TierLeases.let_go`), so that no
    segment holds values older and newer than another's, and the readable keys are
    still exactly the newest ones, in put order."""
    monkeypatch.setattr(SegmentCleaner, "ensure_started", lambda self: None)  # driven here
    monkeypatch.setattr(SegmentCleaner, "wake", lambda self: None)
    s = _store(tmp_path, disk_segments=16)
    assert s.memory is not None
    puts = [0]
    # around allowed for 3 puts of every 5: a switch every few values, mid-segment
    monkeypatch.setattr(s._dirty, "room", lambda: puts[0] % 5 < 3)
    keys = [f"s{i}" for i in range(12 * 8 * PER_SEG)]

    def count() -> None:
        puts[0] += 1

    _put_driven(s, keys, count)
    readable = _newest_readable(s, keys)
    assert len(readable) > 8 * PER_SEG
    assert s.stats["written_around"] > 0 and s.stats["spilled"] > 0
    s.close()


def test_a_spill_evicts_no_segment_newer_than_itself(tmp_path: Path) -> None:
    """A spill reaching a full disk tier (puts written around took the segments ready
    when the cleaner chose to spill) empties the disk's least recently used segment only
    when that one is older than the spilled segment; newer, the spill is refused (its
    values, the store's oldest, are evicted by the caller) and nothing here is lost."""
    s = LocalStore(tmp_path / "kv", capacity_bytes=4 * SEG, segment_bytes=SEG)
    keys = [f"d{i}" for i in range(4 * PER_SEG)]
    for k in keys:
        assert s.put_many([(k, value_of(k))]) == [True]
    s.disk.release_idle_leases(0)
    oldest = min(s.disk._ticks[seg] for seg in range(s.disk.count))
    assert s.disk._new_lease(SEG // 2, stamp=oldest - 1) is None
    assert s.get_many(keys) == [value_of(k) for k in keys], "a newer segment was evicted"
    files = {k: s.where(k).file for k in keys}  # type: ignore[union-attr]
    ticks = {seg: s.disk._ticks[seg] for seg in range(s.disk.count)}  # the reads stamped them
    oldest_seg = min(ticks, key=ticks.__getitem__)
    lease = s.disk._new_lease(SEG // 2, stamp=ticks[oldest_seg] + 1)
    assert lease is not None and lease.seg == oldest_seg and lease.end == 0
    assert s.disk._ticks[lease.seg] == ticks[oldest_seg] + 1
    evicted = [k for k in keys if files[k] == s.disk.files.where(oldest_seg)]
    assert len(evicted) == PER_SEG and s.get_many(evicted) == [None] * PER_SEG
    kept = [k for k in keys if k not in evicted]
    assert s.get_many(kept) == [value_of(k) for k in kept]
    s.disk._seal(lease)
    s.close()


def test_without_a_cleaner_process_a_thread_keeps_the_same_order(
    tmp_path: Path, monkeypatch
) -> None:
    """Where the cleaner process cannot be started, the writer's cleaner thread does its
    work: both reserves, one recency order (puts written around included), and the
    readable keys are the newest ones, in put order."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise OSError(11, "no processes left")

    monkeypatch.setattr(segment_cleaner.subprocess, "Popen", refuse)
    s = _store(tmp_path, disk_segments=16)
    monkeypatch.setattr(s._dirty, "room", lambda: True)
    keys = [f"t{i}" for i in range(12 * 8 * PER_SEG)]
    again = _put_all(s, keys)
    assert s.memory is not None and s.memory.cleaner.pid is None
    readable = _newest_readable(s, keys, again)
    assert len(readable) > 8 * PER_SEG and s.stats["evictions"] > 0
    s.close()


def test_a_put_written_around_never_empties_a_segment(tmp_path: Path, monkeypatch) -> None:
    """The cleaner stopped: puts go around the full memory tier while the disk tier has
    segments never used, then are skipped at once: none empties a disk segment itself
    (that is the cleaner's, in the recency order). Let go, the cleaner refills both
    reserves and puts store again."""
    s = _store(tmp_path, disk_segments=16)
    monkeypatch.setattr(s._dirty, "room", lambda: True)
    pid = _stop_cleaner(s)
    keys = [f"x{i}" for i in range(4 * 16 * PER_SEG)]
    try:
        answers = [s.put_many([(k, value_of(k))]) == [True] for k in keys]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert s.stats["evictions"] == 0 and s.stats["written_around"] > 0
    assert False in answers, "the disk tier never ran out of ready segments"
    stored = [k for k, ok in zip(keys, answers, strict=True) if ok]
    assert s.get_many(stored) == [value_of(k) for k in stored]
    assert s.memory is not None and s.memory.cleaner.wait_idle(60)
    deadline = time.monotonic() + 60
    while s.put_many([("after", value_of("after"))]) != [True]:
        assert time.monotonic() < deadline, "puts stayed skipped after the cleaner ran"
        time.sleep(0.01)
    assert s.get_many(["after"]) == [value_of("after")]
    s.close()


def test_spill_writes_run_on_a_low_priority_thread(tmp_path: Path) -> None:
    """The cleaner process writes its spills on a thread at SPILL_WRITE_NICE (so that a
    put sharing its core runs first), while its own thread, which holds the index's
    transactions, keeps its parent's priority. The write's error reaches the caller."""
    writer = SpillWriter()
    try:
        got: list[int] = []
        writer.run(lambda: got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        assert got == [max(SPILL_WRITE_NICE, os.nice(0))]

        def fails() -> None:
            raise OSError(28, "no space")

        with pytest.raises(OSError, match="no space"):
            writer.run(fails)
    finally:
        writer.close()
    s = _store(tmp_path)
    _put_all(s, [f"n{i}" for i in range(3 * 8 * PER_SEG)])
    # puts that found the reserve dry went around it: the cleaner spills once it runs
    assert s.memory is not None and s.memory.cleaner.wait_idle(60)
    _put_all(s, ["counted"])  # the store's counters, read again
    pid = s.memory.cleaner.pid
    assert pid is not None and s.stats["spilled"] > 0
    nice = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            nice[int(task)] = int(f.read().rsplit(")", 1)[1].split()[16])
    assert nice[pid] == os.nice(0), nice
    assert max(SPILL_WRITE_NICE, os.nice(0)) in [n for t, n in nice.items() if t != pid], nice
    s.close()


#: The cleaner process as SegmentCleaner starts it, with its looks counted (written to
#: the file named in argv[2] when it ends) and, given in argv[3], its idle poll.
_COUNTING_CHILD = (
    "import json, sys; a = json.loads(sys.argv[1]); sys.path[:0] = a['sys_path']; "
    "from ucm_patch.hooks.stores import cleaner_process as c; n = [0]; real = c.refill_two\n"
    "def counted(*args, **kw):\n    n[0] += 1\n    return real(*args, **kw)\n"
    "c.refill_two = counted; c.IDLE_POLL_S = float(sys.argv[3])\n"
    "try:\n    c.main(a)\nfinally:\n    open(sys.argv[2], 'w').write(str(n[0]))\n"
)


def _counting_cleaner(monkeypatch, out: Path, idle_poll_s: float) -> None:
    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kw: object) -> subprocess.Popen:
        if cmd[1:3] != ["-c", segment_cleaner._CHILD]:
            return real_popen(cmd, **kw)  # not the cleaner: anything else the suite starts
        return real_popen([cmd[0], "-c", _COUNTING_CHILD, cmd[3], str(out), str(idle_poll_s)], **kw)

    monkeypatch.setattr(segment_cleaner.subprocess, "Popen", popen)


def test_a_busy_store_cleaner_looks_when_woken_not_every_few_ms(
    tmp_path: Path, monkeypatch
) -> None:
    """Hits and puts into the segment a writer keeps take no segment from the reserve: its
    cleaner process then looks at the index only every IDLE_POLL_S (it used to look every
    2 ms whenever the store was busy: with 4 writers on 2 cores the 4 cleaners' looks
    took 0.4 of a core). The count comes from the process itself."""
    from ucm_patch.hooks.stores.cleaner_process import IDLE_POLL_S

    out = tmp_path / "looks"
    _counting_cleaner(monkeypatch, out, IDLE_POLL_S)
    s = _store(tmp_path)
    _put_all(s, ["a", "b"])
    assert s.memory is not None and s.memory.cleaner.wait_idle(60)
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        assert s.get_many(["a", "b"]) == [value_of("a"), value_of("b")]  # recency moves
    busy = time.monotonic() - started
    s.close()
    looks = int(out.read_text())
    # its first looks (the start, the reserve), one per IDLE_POLL_S, and slack for wakes
    allowed = (time.monotonic() - started) / IDLE_POLL_S + 20
    assert looks <= allowed, f"{looks} looks in {busy:.2f} s of hits (at most {allowed:.0f})"


def test_a_wake_makes_the_cleaner_refill_without_waiting_for_its_poll(
    tmp_path: Path, monkeypatch
) -> None:
    """With its poll at 60 s, the cleaner process still refills the reserve as puts take
    it: each take wakes it through its pipe (SegmentCleaner.wake), and a spill's end
    wakes it for the next. Puts past a memory tier and a half are all stored."""
    _counting_cleaner(monkeypatch, tmp_path / "looks", 60.0)
    s = _store(tmp_path)
    keys = [f"w{i}" for i in range(12 * PER_SEG)]
    started = time.monotonic()
    _put_all(s, keys)
    assert s.memory is not None and s.memory.cleaner.wait_idle(30)
    assert time.monotonic() - started < 30, "the cleaner waited for its poll"
    assert s.get_many(keys) == [value_of(k) for k in keys]  # spilled, none dropped
    _put_all(s, ["counted"])  # the store's counters, read again
    assert s.stats["spilled"] > 0
    s.close()
    assert int((tmp_path / "looks").read_text()) > 0


def test_wake_pipe_never_blocks_and_never_writes_after_close() -> None:
    """A writer's wake is one non-blocking write: a full pipe (wakes not read yet) does
    not raise or wait, and once closed no wake writes to the descriptor number (another
    file may have it by then). The cleaner's Waker returns on a wake, reads every pending
    one at once, and stops watching a pipe whose writer closed it (no busy loop), closing
    its read end."""
    from ucm_patch.hooks.stores.cleaner_process import Waker
    from ucm_patch.hooks.stores.segment_cleaner import WakePipe

    pipe = WakePipe()
    for _ in range(100_000):  # far past a pipe's 64 KiB
        pipe.wake()
    read_fd = pipe.read_fd
    assert len(os.read(read_fd, 1 << 20)) == 65536
    pipe.close()
    pipe.close()  # once is enough; twice does nothing
    with pytest.raises(OSError):
        os.fstat(read_fd)
    reused = os.open(os.devnull, os.O_WRONLY)  # likely the number the pipe had
    try:
        pipe.wake()  # writes nowhere
    finally:
        os.close(reused)

    r, w = os.pipe()
    waker = Waker(r)
    try:
        t = time.monotonic()
        os.write(w, b"\0" * 10)
        waker.wait(30)
        waker.wait(0.05)  # all ten were read by the first wait: this one times out
        assert time.monotonic() - t < 5
        threading.Timer(0.05, waker.poke).start()
        t = time.monotonic()
        waker.wait(30)
        assert time.monotonic() - t < 5
        os.close(w)
        waker.wait(30)  # the writer's end closed: seen, and no longer waited on
        with pytest.raises(OSError):
            os.fstat(r)  # its read end closed then, not left open until the cleaner ends
        t = time.monotonic()
        waker.wait(0.2)
        assert time.monotonic() - t >= 0.15
    finally:
        waker.close()


def test_writeback_starts_from_the_spilling_thread(tmp_path: Path) -> None:
    """A disk segment's spilled bytes are sent to the device by the thread that wrote
    them (sync_file_range, found in libc): the kernel's flusher threads, which run at
    normal priority beside the puts, then have nothing left to write."""
    assert segment_files._START_WRITEBACK is not None, "sync_file_range not found in libc"
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, os.urandom(1 << 20), 0)
        start = segment_files._START_WRITEBACK
        assert start(fd, 0, 1 << 20, segment_files.SYNC_FILE_RANGE_WRITE) == 0
        assert start(-1, 0, 1 << 20, segment_files.SYNC_FILE_RANGE_WRITE) == -1  # it is called
    finally:
        os.close(fd)


def test_values_stay_readable_until_evicted_by_recency(tmp_path: Path) -> None:
    """Across the spill, a value answered True is readable until it is evicted by the
    recency order: with a disk tier that holds a fraction of what was put, the readable
    keys are exactly the newest ones (a suffix of the put order), and far more than the
    memory tier holds."""
    s = _store(tmp_path, disk_segments=16)
    keys = [f"r{i}" for i in range(10 * 8 * PER_SEG)]
    again = _put_all(s, keys)
    readable = _newest_readable(s, keys, again)
    assert len(readable) > 8 * PER_SEG
    s.close()


def test_a_writer_keeps_its_segment_between_puts(tmp_path: Path, monkeypatch) -> None:
    """Writers that add up: in steady state a put is one index transaction (its publish);
    the lease is taken once per segment, not claimed and given back around every put."""
    counts = {"claim": 0, "release": 0, "publish": 0}
    for name in counts:
        real = getattr(SegmentIndex, name)

        def counted(self, *a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            counts[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(SegmentIndex, name, counted)
    s = LocalStore(tmp_path / "kv", capacity_bytes=256 * SEG, segment_bytes=SEG)
    puts = 4 * PER_SEG
    for i in range(puts):
        assert s.put_many([(f"p{i}", value_of(f"p{i}"))]) == [True]
    assert counts["publish"] == puts
    assert counts["claim"] <= 5 and counts["release"] <= 5, counts
    s.close()


# -- killed processes -------------------------------------------------------------------------


#: Values a killed-process test's writer stores at most, and a disk tier holding every
#: writer's: nothing is evicted, so every value answered True must be readable.
WRITER_VALUES, ROUNDS = 6000, 3
KILL_DISK_SEGMENTS = ROUNDS * WRITER_VALUES // PER_SEG + 64


def _writer(root: str) -> None:
    """Puts until it stored WRITER_VALUES, printing its cleaner's pid once and every key
    answered True; then waits to be killed."""
    s = _store(Path(root), KILL_DISK_SEGMENTS)
    assert s.memory is not None
    n = done = 0
    while done < WRITER_VALUES:
        k = f"w{os.getpid()}-{n}"
        if s.put_many([(k, value_of(k))]) == [True]:
            print(k, flush=True)
            done += 1
        if n == 0:
            print(f"cleaner {s.memory.cleaner.pid}", flush=True)
        n += 1
    time.sleep(3600)


def _start_writer(root: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--writer", str(root)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("cleaner "):
            return proc, int(line.split()[1])
    raise AssertionError("the writer died before its first put")


def _collect(proc: subprocess.Popen[str]) -> list[str]:
    """Every key the writer prints, gathered by a thread until its stdout closes."""
    keys: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        keys.extend(line.strip() for line in proc.stdout if line.strip())

    threading.Thread(target=read, daemon=True).start()
    return keys


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's first process may not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return not pid_alive(pid)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not _exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("victim", ["cleaner", "writer"])
def test_killed_mid_spill_loses_nothing_stored(tmp_path: Path, victim: str) -> None:
    """SIGKILL at random moments of a full store's steady state (the cleaner spilling a
    segment every few puts): the cleaner itself, or the writer whose cleaner it is. Every
    value the writer was answered True for stays readable (from either tier), none reads
    corrupt, a writer's cleaner never outlives it, and a new writer stores again (the
    segment the dead cleaner held is taken over)."""
    rng = random.Random(20261127)
    stored: list[str] = []
    for _round in range(ROUNDS):
        proc, cleaner = _start_writer(tmp_path)
        keys = _collect(proc)
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(cleaner if victim == "cleaner" else proc.pid, signal.SIGKILL)
        if victim == "cleaner":  # the writer goes on, and starts another cleaner
            assert _gone(cleaner)
            count = len(keys)
            deadline = time.monotonic() + 30
            while len(keys) < min(count + 4 * 8 * PER_SEG, WRITER_VALUES - 1):  # spills again
                assert time.monotonic() < deadline, "the writer stayed dry: no new cleaner"
                time.sleep(0.05)
            proc.kill()
        proc.wait(30)
        time.sleep(0.2)  # the reader thread drains the pipe
        stored += keys
        assert _gone(cleaner), "the cleaner outlived its writer"
        s = _store(tmp_path, KILL_DISK_SEGMENTS)
        got = s.get_many(stored)
        lost = [k for k, v in zip(stored, got, strict=True) if v != value_of(k)]
        assert not lost, f"{len(lost)} stored values lost, e.g. {lost[:3]}"
        assert s.stats["corrupt"] == 0
        s.close()
    s = _store(tmp_path, KILL_DISK_SEGMENTS)
    _put_all(s, [f"after-{i}" for i in range(3 * 8 * PER_SEG)])
    assert s.get_many(stored) == [value_of(k) for k in stored]
    s.close()


def test_the_cleaner_process_never_outlives_its_store(tmp_path: Path) -> None:
    """Closed, the store stops its cleaner; dropped without close, the cleaner ends with
    it; and a cleaner whose tier directory was removed behind it ends too (it never makes
    the directory again)."""
    s = _store(tmp_path / "a")
    _put_all(s, ["x"])
    closed = s.memory.cleaner.pid  # type: ignore[union-attr]
    s.close()
    assert closed is not None and _exited(closed)
    s = _store(tmp_path / "b")
    _put_all(s, ["x"])
    dropped = s.memory.cleaner.pid  # type: ignore[union-attr]
    del s
    gc.collect()
    assert dropped is not None and _gone(dropped)
    s = _store(tmp_path / "c")
    _put_all(s, ["x"])
    orphan = s.memory.cleaner.pid  # type: ignore[union-attr]
    assert orphan is not None
    shutil.rmtree(tmp_path / "c" / "shm")
    assert _gone(orphan) and not (tmp_path / "c" / "shm").exists()


if __name__ == "__main__" and sys.argv[1:2] == ["--writer"]:
    _writer(sys.argv[2])
