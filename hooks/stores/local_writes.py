"""The local store's two-tier put path (:class:`LocalWrites`, a part of
:class:`~.local.LocalStore`): values go into the memory tier, around it into ready disk
segments when its reserve runs dry, straight to disk when larger than a memory segment,
and the memory tier's spills land in the disk tier. A put never waits for a spill, an
eviction or a disk write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xxhash import xxh3_128_digest

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.dirty_pages import DirtyGauge
from ucm_patch.hooks.stores.framing import as_bytes_view, key_bytes
from ucm_patch.hooks.stores.segment_files import SegmentLost
from ucm_patch.hooks.stores.tier import RECORD_HEADER, Held, Record, Tier

#: The counters the tiers keep (by every process, for the shared ones), summed in ``stats``.
TIER_COUNTERS = ("evictions", "spilled", "disk_full", "reserve_dry")


class LocalWrites(KVStore):
    """The put path of a :class:`~.local.LocalStore`: its state (below) is set up by the
    store's ``__init__``; the stats and closed flag are :class:`KVStore`'s."""

    path: str
    disk: Tier
    memory: Tier | None
    tiers: tuple[Tier, ...]
    fsync: bool
    _dirty: DirtyGauge
    _around: bool
    _warn: RateLimitedLog

    def _tier_counts(self) -> Mapping[str, int]:
        return {c: sum(getattr(t, c) for t in self.tiers) for c in TIER_COUNTERS}

    def _sync_counters(self) -> None:
        """The tiers count what they evict, spill and relieve; stats shows their sums."""
        self._set_counts(self._tier_counts)

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store values (first value per key wins); False when larger than a segment."""
        self._check_open()
        records: list[Record] = []
        for key, value in items:
            kb = key_bytes(key)
            view = value if type(value) is memoryview else memoryview(value)
            if view.format != "B" or view.ndim != 1:
                view = as_bytes_view(view)
            records.append((xxh3_128_digest(kb), kb, view))
        unique = len({r[0] for r in records}) == len(records)
        first: dict[bytes, int] = {}
        if not unique:  # a key twice in one put: its first value is the one stored
            for i, record in enumerate(records):
                first.setdefault(record[0], i)
            records = [records[i] for i in sorted(set(first.values()))]
        try:
            stored = self._put(records)
        except StoreError:
            self._count(errors=1)
            raise
        finally:
            self._sync_counters()
        written = sum([len(r[2]) for r, ok in zip(records, stored, strict=True) if ok])
        if not all(stored):
            self._say_skipped(records, stored)
        if not unique:
            at = {r[0]: ok for r, ok in zip(records, stored, strict=True)}
            stored = [at[xxh3_128_digest(key_bytes(k))] for k, _v in items]
        self._count(puts=len(items), skipped_full=stored.count(False), bytes_written=written)
        return stored

    def _say_skipped(self, records: list[Record], stored: list[bool]) -> None:
        """Why values were not stored, one WARNING per cause per 30 s (with the count of
        the lines held back): larger than a segment, or every segment being written by
        live processes. Only when a put skipped something: never on the normal path."""
        limit = self.disk.segment_bytes - RECORD_HEADER
        big = [
            len(r[2]) for r, ok in zip(records, stored, strict=True) if not ok and len(r[2]) > limit
        ]
        busy = stored.count(False) - len(big)
        if big:
            self._warn.warning(
                "value larger than a segment",
                "local store %s: %d value(s) of up to %d bytes not stored: larger than a "
                "segment holds (%d bytes: local_segment_bytes, or a quarter of "
                "local_capacity_bytes when smaller, fixed when the directory was created)",
                self.path, len(big), max(big), limit,
            )  # fmt: skip
        if busy and self.memory is not None:
            self._warn.warning(
                "memory tier dry",
                "local store %s: %d value(s) not stored: no segment of the memory tier %s "
                "was ready (its cleaner spills to the disk tier slower than values arrive, "
                "or live processes write all %d segments), and none went around it to the "
                "disk tier: it had no segment ready either, or the host's dirty pages are "
                "past the line where the kernel pauses writers (a put never waits for a "
                "spill, an eviction or a disk write)",
                self.path, busy, self.memory.path, self.memory.count,
            )  # fmt: skip
        elif busy:
            self._warn.warning(
                "every segment busy",
                "local store %s: %d value(s) not stored: all %d segments of the disk tier are "
                "being written by live processes (raise local_capacity_bytes for more)",
                self.path, busy, self.disk.count,
            )  # fmt: skip

    def _put(self, records: list[Record]) -> list[bool]:
        """Write into the first tier. A key already there is written again and then left
        as it was by the index (the first value wins): no lookup before every put, as a
        dump of a key already stored is rare (the scheduler dumps what a lookup missed).

        A value the memory tier had no ready segment for (its reserve ran dry: the store
        is full and values come faster than the spills) is **written around** it, into
        a ready segment of the disk tier's (:meth:`_write_around`): one copy into the
        page cache, where the memory tier costs it two (this put's, then the spill's).
        Past what that allows, the value is skipped (False, counted): the put never
        waits for a spill, an eviction or a disk write. A value larger than a memory
        segment always goes to the disk tier."""
        memory = self.memory
        try:
            if memory is None:
                return self.disk.put(records)
            tried_around = self._around and self._may_go_around()
            if self._around and not tried_around:  # back to the memory tier: see _write_around
                self._around = False
                self.disk.let_go()
            if tried_around:
                done = [False] * len(records)
                self._write_around(records, list(range(len(records))), done)
                todo = [i for i, ok in enumerate(done) if not ok]
                if todo:
                    for i, ok in zip(todo, memory.put([records[i] for i in todo]), strict=True):
                        done[i] = ok
            else:
                done = memory.put(records)  # the common case: the memory tier has room
            if all(done):
                return done
            limit = memory.segment_bytes - RECORD_HEADER
            big = [i for i, ok in enumerate(done) if not ok and len(records[i][2]) > limit]
            if big:
                for i, ok in zip(big, self.disk.put([records[i] for i in big]), strict=True):
                    done[i] = ok
            todo = [i for i, ok in enumerate(done) if not ok]
            if todo and not tried_around and self._may_go_around():
                self._write_around(records, todo, done)
        except (OSError, SegmentLost) as exc:
            raise StoreError(f"local store {self.path!r}: {exc}") from exc
        return done

    def _may_go_around(self) -> bool:
        """A put may go around the memory tier: its disk tier does not fsync (the put
        would wait for the disk), and the kernel lets pages be dirtied without pausing
        the writer (:class:`~.dirty_pages.DirtyGauge`)."""
        return not self.fsync and self._dirty.room()

    def _write_around(self, records: list[Record], todo: list[int], done: list[bool]) -> None:
        """Put ``records[todo]`` into the disk tier, marking ``done``: only into a segment
        with room or one the cleaner emptied ahead (never evicting here), when
        :meth:`_may_go_around`.

        Once a put went around, this process keeps writing around until its disk segment
        is full, and only then goes back to the memory tier: a segment then holds values
        put one after the other, so that the cleaner's one recency order over both tiers
        (:func:`~.segment_cleaner.refill_two`, by segment) is the order they were put in.
        Alternating per put, each segment would mix older and newer values. For the
        same reason the tier left is let go of (:meth:`~.tier_leases.TierLeases.let_go`):
        the segment this process appended to there is not appended to again once values
        went into the other tier."""
        had = self._around
        stored = self.disk.put([records[i] for i in todo], evict=False)
        for i, ok in zip(todo, stored, strict=True):
            done[i] = ok
        self._around = self.disk.holds_kept_lease()
        assert self.memory is not None
        if any(stored) and not had:
            self.memory.let_go()
        if not self._around:
            self.disk.let_go()
        if not (had and self._around and all(stored)):
            # a ready disk segment was taken (or none was left): its process refills the
            # disk tier's reserve too; a put into the segment it kept takes none
            self.memory.cleaner.wake()
        if any(stored):
            self._count(written_around=sum(stored))

    def _spill(self, view: memoryview, live: list[Held], stamp: int) -> bool:
        """A memory segment's values leaving it go to the disk tier (:meth:`Tier.take_spill`)."""
        return self.disk.take_spill(view, live, stamp)
