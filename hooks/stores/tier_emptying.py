"""Emptying a tier's segments (:class:`TierEmptying`, a part of :class:`~.tier.Tier`):
the values of a segment taken back are handed to ``spill`` (the memory tier spills to
the disk tier) or dropped, then its generation goes up, which makes every entry into it
stale at once. Here too: the reserve of ready segments a cleaner keeps, a full disk
relieved, a tier shrunk to a smaller capacity or trimmed when nobody uses it, the counts
of values spilled and dropped, and the other side of a spill: a spilled segment adopted
in one write.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import CorruptValue
from ucm_patch.hooks.stores.segment_files import FileSegments
from ucm_patch.hooks.stores.segment_index import LOC, SegmentIndex, SegRow
from ucm_patch.hooks.stores.tier_records import FRAME_AT, RECORD_HEADER, Held, Record, Spill


class TierEmptying:
    """Emptying, spilling and adopting segments of a :class:`~.tier.Tier`: its state
    (below) is set up by the tier's ``__init__``. Leases come from
    :class:`~.tier_leases.TierLeases`, puts and lookups from
    :class:`~.tier_writes.TierWrites` and :class:`~.tier_reads.TierReads`."""

    name: str
    path: str
    count: int
    segment_bytes: int
    spill: Spill | None
    reserve: int
    fsync: bool
    files: FileSegments
    index: SegmentIndex
    run_spill_write: Callable[[Callable[[], None]], None]
    disk_full: int
    _dropped: int
    _ticks: memoryview
    _shared: memoryview
    _shared_base: tuple[int, ...]
    _lock: threading.Lock
    _warn: RateLimitedLog
    _dir: int

    # -- the reserve ------------------------------------------------------------------------

    def empty_one_for_reserve(self) -> bool:
        """One step of the cleaner (:mod:`.segment_cleaner`): when fewer than
        :attr:`reserve` segments are ready (never used, or emptied and nobody's), spill and
        empty the least recently used one nobody writes, and give it back ready. True when
        it emptied one (call again), False when the reserve is full or nothing can be
        emptied now."""
        ready, victims = self.reserve_state()
        if ready >= self.reserve:
            return False
        return any(self.empty_segment(victim) for victim in victims)

    def empty_segment(self, victim: tuple[int, int, SegRow], drop: bool = False) -> bool:
        """Empty one segment of :meth:`reserve_state`'s victims, spilling its values (or
        dropping them with ``drop``) and giving it back ready: False when another process
        took it first (:func:`~.segment_cleaner.refill_two`)."""
        _tick, seg, row = victim
        return self._empty(seg, row, remove=False, release=True, drop=drop) is not None

    def reserve_short(self) -> bool:
        """Whether the reserve lacks segments that could be emptied now (tools, tests)."""
        if not self.reserve:
            return False
        ready, victims = self.reserve_state()
        return ready < self.reserve and bool(victims)

    def reserve_state(self) -> tuple[int, list[tuple[int, int, SegRow]]]:
        """(segments ready: never used, or emptied and nobody's; the segments that could be
        emptied now, as (last use, segment, row), least recently used first): what a
        cleaner decides from."""
        rows = self.index.segments()
        ready = self.count - sum(1 for s in rows if s < self.count)
        victims = []
        for seg, row in rows.items():
            if seg < self.count and self._takeable(row):
                if row.end:
                    victims.append((self._ticks[seg], seg, row))
                else:
                    ready += 1
        return ready, sorted(victims)

    # -- emptying ---------------------------------------------------------------------------

    def _empty(
        self, seg: int, row: SegRow, remove: bool, release: bool = False, drop: bool = False
    ) -> int | None:
        """Take ``seg`` from its (dead or absent) owner, spill its live values (drop them
        with ``drop``: the recency order evicts them), start it over (and remove its file
        when ``remove``): the new generation, owned by this process (given back again
        when ``remove`` or ``release``), or None when another process took it."""
        me = os.getpid()
        counts = (0, 0)  # (spilled, dropped) by the spill
        if row.end and self.spill is not None and not drop:
            # held while its values are copied out, so that no writer appends meanwhile
            if self.index.claim(seg, row, me, empty=False) is None:
                return None
            row = SegRow(row.gen, row.end, me)
            alive = self.index.held(seg, row.gen)
            if alive:
                counts = self._spill(seg, alive)
        # given back (owner 0) in the same transaction that empties it when asked: a
        # cleaner refilling a reserve beside several writers spends one transaction per
        # segment, not two
        emptied = self.index.empty(seg, row, 0 if remove or release else me)
        if emptied is None:
            return None
        gen, dropped = emptied
        if drop:  # by a cleaner: counted where every process's stats see it
            counts = (0, dropped)
        elif self.spill is None and dropped:
            with self._lock:
                self._dropped += dropped
        if any(counts):  # after the release: writers read a change as "a segment is ready"
            self._count_shared(*counts)
        if remove:
            self.files.remove(seg)
        return gen

    def _spill(self, seg: int, live: list[Held]) -> tuple[int, int]:
        """Hand the segment's records up to its last live one, and the live ones, to
        ``spill``: (values spilled, values dropped because that failed), for the caller to
        count once the segment is empty. A mapped segment is handed as its mapping: the
        disk write reads it from there, no copy in between."""
        assert self.spill is not None
        try:
            end = (max(off + FRAME_AT + size for _d, off, size in live) + 63) & ~63
            view = self.files.mapping(seg, end)
            if view is None:
                view = memoryview(self.files.read(seg, 0, end))
            if self.spill(view[:end], live, self._ticks[seg]):
                return len(live), 0
            return 0, len(live)  # older than any segment the spill could go to: evicted
        except (StoreError, CorruptValue, OSError) as exc:
            self._warn.warning(
                "spill", "%s tier: spilling segment %d failed: %s", self.name, seg, exc
            )
        return 0, len(live)

    def _relieve(self, need: int, exc: OSError) -> None:
        """ENOSPC: empty least recently used segments and remove their files until ``need``
        bytes and a tenth of the tier are freed (so the next puts do not hit the wall at
        once), then the caller retries once."""
        rows = self.index.segments()
        order = sorted(
            (self._ticks[s], s, r) for s, r in rows.items() if r.end and self._takeable(r)
        )
        goal = max(need, sum(r.end for r in rows.values()) // 10)
        freed = 0
        for _tick, seg, row in order:
            if freed >= goal:
                break
            if self._empty(seg, row, remove=True) is not None:
                freed += row.end
        with self._lock:
            self.disk_full += 1
        self._warn.warning(
            "enospc",
            "%s tier %s: file system full (%s); emptied %d bytes of segments, retrying once",
            self.name,
            self.path,
            exc.strerror,
            freed,
        )

    def _shrink(self) -> None:
        """Segments beyond this capacity (a smaller one than last time) are emptied and
        their files removed, unless a live process still writes them."""
        for seg, row in sorted(self.index.segments().items()):
            if seg >= self.count and row.end and self._takeable(row):
                self._empty(seg, row, remove=True)

    def trim(self, keep_bytes: int, deadline: float) -> int:
        """Shrink the tier to at most ``keep_bytes`` of segment files, for the time no
        process uses it (the last one's close, :mod:`.memory_tiers`; the caller holds the
        tier alone). The most recently used segments holding values stay while they fit;
        the values of every other one go to ``spill``, most recently used first, until
        ``deadline`` (``time.monotonic``), and its file is removed, as is every segment
        file holding nothing. Values dropped without a spill (past the deadline): returned,
        and counted in ``evictions``."""
        self.quiesce()
        rows = self.index.segments()
        used = sorted(
            ((self._ticks[seg], seg) for seg, row in rows.items() if row.end),
            reverse=True,
        )
        keep: set[int] = set()
        for _tick, seg in used[: max(0, keep_bytes) // self.segment_bytes]:
            keep.add(seg)
        me = os.getpid()
        lost = 0
        for _tick, seg in used:
            if seg in keep:
                continue
            row = rows[seg]
            if time.monotonic() < deadline and self._empty(seg, row, remove=True) is not None:
                continue
            current = self.index.segments().get(seg)
            if current is None or not current.end:
                continue
            dropped = self.index.empty(seg, current, me)
            if dropped is not None:
                lost += dropped[1]
                self.index.release(seg, dropped[0], me)
        with self._lock:
            self._dropped += lost
        for name in os.listdir(self._dir):
            if name.startswith("seg-") and name[4:].isdigit() and int(name[4:]) not in keep:
                self.files.remove(int(name[4:]))
        return lost

    # -- counts -----------------------------------------------------------------------------

    def _count_shared(self, spilled: int, dropped: int) -> None:
        """Add to the tier's shared counts. Not atomic across processes: two cleaners that
        finish a spill in the same instant may count one of them short (a statistic, not
        a state anything acts on)."""
        counts = self._shared
        counts[0] += spilled
        counts[1] += dropped

    @property
    def spilled(self) -> int:
        """Values spilled from this tier since this process opened it, by any process."""
        return self._shared[0] - self._shared_base[0]

    @property
    def evictions(self) -> int:
        """Values dropped, not spilled, since this process opened the tier: by this process
        for capacity, or by any process's failed spill."""
        return self._dropped + self._shared[1] - self._shared_base[1]

    # -- adopting a spilled segment ---------------------------------------------------------

    def adopt(self, src: memoryview, live: Sequence[Held], stamp: int | None = None) -> bool:
        """Take a whole segment of another tier being emptied (a spill): ``src`` is its
        records from offset 0 (the same record layout as here), ``live`` the values among
        them still current there. One write of ``src`` into a segment here, then one
        index transaction publishing ``live`` at the same offsets (shifted by where the
        write went; a key already current here keeps its value). Its other records are
        written too but never published (dead bytes until the segment is reused). False
        when ``src`` does not fit a segment here (:meth:`take_spill` then spills value by
        value), or no segment here may take it: every one a live process's lease, or
        (with ``stamp``) none ready and none used less recently. StoreError when the write fails
        (ENOSPC: least recently used segments are emptied and it is tried once more).
        ``stamp``: the spilled segment's last use, which the segment here takes
        (:meth:`_leased`); None: now. With ``stamp``, a segment here is emptied for the
        spill only when it was used less recently than the spilled one (the cleaner's
        choice to spill rather than drop, :func:`~.segment_cleaner.refill_two`, was made
        before puts written around took the segments then ready)."""
        n = len(src)
        if n > self.segment_bytes or n & 63:
            return False
        me = os.getpid()
        for attempt in range(2):
            lease = self._new_lease(n, stamp=stamp)
            if lease is None:
                return False
            seg, gen, start = lease.seg, lease.gen, lease.end
            try:
                try:
                    self.files.new_batch()
                    self.run_spill_write(partial(self._write_spill, seg, start, src))
                except OSError as exc:
                    self.files.cut(seg, start)
                    if exc.errno != errno.ENOSPC or attempt:
                        raise StoreError(
                            f"{self.name} tier: cannot write {self.files.where(seg)!r}: {exc}"
                        ) from exc
                    self._seal_quietly(lease)
                    lease = None
                    self._relieve(n, exc)
                    continue
                pack = LOC.pack
                locs = [(d, pack(seg, gen, start + off, size)) for d, off, size in sorted(live)]
                if not self.index.publish(seg, gen, me, locs, start, start + n):
                    raise StoreError(f"{self.name} tier: lost segment {seg} mid-write")
                lease.end = start + n
                if stamp is None:
                    self.touch(seg)
            finally:
                if lease is not None:
                    self._seal_quietly(lease)
            return True
        return False

    def _write_spill(self, seg: int, start: int, src: memoryview) -> None:
        """A spilled segment's bytes into ``seg`` at ``start``, then on their way to the
        device (fsync'd with ``fsync``, else written back from this thread:
        :meth:`~.segment_files.FileSegments.start_writeback`)."""
        self.files.write(seg, start, [src])
        if self.fsync:
            self.files.sync(seg)
        else:
            self.files.start_writeback(seg, start, len(src))

    def take_spill(self, view: memoryview, live: list[Held], stamp: int | None = None) -> bool:
        """The :data:`Spill` of the tier above (the memory tier over the disk tier): a
        segment in one write (:meth:`adopt`), or value by value when this tier's segments
        are smaller (a directory created with an older size). The first value wins.
        False: not taken, as every segment here is newer than the spilled one (``stamp``)
        and none is ready, or every one is a live process's lease: its values are the
        store's oldest, dropped by the recency order (the caller counts them evicted)."""
        if len(view) <= self.segment_bytes and not len(view) & 63:
            return self.adopt(view, live, stamp)
        records: list[Record] = [
            (d, bytes(view[off + FRAME_AT : off + RECORD_HEADER]),
             view[off + RECORD_HEADER : off + FRAME_AT + size])
            for d, off, size in live
        ]  # fmt: skip
        present = self.lookup([d for d, _h, _p in records])
        self.put([r for r, loc in zip(records, present, strict=True) if loc is None], framed=True)
        return True


__all__ = ["TierEmptying"]
