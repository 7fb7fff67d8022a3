"""Which segment of a tier a process appends to (:class:`TierLeases`, a part of
:class:`~.tier.Tier`): a lease taken (the most recently used segment with room, else a
ready one, else, in a tier that does not spill, the least recently used one emptied),
kept between puts, and given back.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.publish_channel import PublishClient, is_beside_forward
from ucm_patch.hooks.stores.segment_cleaner import LEASE_IDLE_S, SegmentCleaner
from ucm_patch.hooks.stores.segment_index import SegmentIndex, SegRow, pid_alive
from ucm_patch.hooks.stores.tier_records import Spill

#: How long a put that found the memory tier's reserve dry lets the next puts answer
#: "skipped" without a look at the index, unless a cleaner spilled meanwhile
#: (:meth:`TierLeases._dry_again`): a segment readied without a spill (one with no live
#: values, or a lease given back with room) is seen after at most this long.
DRY_RECHECK_S = 0.002


def _takeable(row: SegRow, owner: int) -> bool:
    """Whether ``owner`` may take the segment of ``row``: nobody's, or a dead process's."""
    return row.owner == 0 or (row.owner != owner and not pid_alive(row.owner))


@dataclass
class Lease:
    """A segment this process appends to: nobody else writes it while we hold it."""

    seg: int
    gen: int
    end: int
    used: float = 0.0  # time.monotonic() of its last put (kept leases: given back when idle)


class TierLeases:
    """The leases of a :class:`~.tier.Tier`: its state (below) is set up by the tier's
    ``__init__``. Calls :meth:`~.tier_emptying.TierEmptying._empty` (a tier that does
    not spill empties a segment for a lease) and :meth:`~.tier.Tier.touch`."""

    name: str
    segment_bytes: int
    count: int
    spill: Spill | None
    reserve: int
    reserve_dry: int
    index: SegmentIndex
    cleaner: SegmentCleaner
    _ticks: memoryview
    _shared: memoryview
    _lock: threading.Lock
    _warn: RateLimitedLog
    _last: Lease | None
    _dry: tuple[int, float] | None
    _kept: list[Lease]
    _kept_pid: int
    _kept_lock: threading.Lock
    _ahead: tuple[int, PublishClient] | None

    # -- kept between puts ------------------------------------------------------------------

    def _take_kept(self) -> Lease | None:
        """A lease this process kept from an earlier put, if one is free."""
        with self._kept_lock:
            if self._kept_pid != os.getpid():  # a forked child: those are its parent's
                self._kept, self._kept_pid, self._last = [], os.getpid(), None
            return self._kept.pop() if self._kept else None

    def _keep(self, lease: Lease, need: int) -> None:
        """Keep ``lease`` for the next put (the cleaner gives it back when idle), or give it
        back now when it has no room for a record of ``need`` bytes (the largest of this
        put: the next one is likely alike), so that the segment can be evicted."""
        if lease.end + need > self.segment_bytes:
            self._seal_quietly(lease)
            return
        lease.used = time.monotonic()
        with self._kept_lock:
            if self._kept_pid == os.getpid():
                self._kept.append(lease)
                lease = None  # type: ignore[assignment]
        if lease is not None:
            self._seal_quietly(lease)
            return
        self.cleaner.ensure_started()

    def _take_ahead(self, need: int) -> None:
        """Keep the leases answered so far to the request of
        :meth:`~.tier_beside_writes.TierBesideWrites.expect_puts`, read without waiting
        (none when they have not come yet): the next puts take them as kept ones."""
        ahead = self._ahead
        if ahead is None:
            return
        pid, client = ahead
        if pid != os.getpid():  # a forked child: that channel is its parent's
            self._ahead = None
            return
        got = client.take_ahead()
        if not client.owes:
            self._ahead = None
        for seg, gen, end, ready in got:
            self._keep(self._leased(seg, gen, end, ready=ready), need)

    def release_idle_leases(self, idle_s: float = LEASE_IDLE_S) -> None:
        """Give back the kept leases unused for ``idle_s`` (the cleaner, and close with 0),
        those answered ahead and not taken by a put yet first kept (so, given back once
        idle)."""
        self._take_ahead(0)
        cutoff = time.monotonic() - idle_s
        with self._kept_lock:
            if self._kept_pid != os.getpid():
                return
            idle = [lease for lease in self._kept if lease.used <= cutoff]
            self._kept = [lease for lease in self._kept if lease.used > cutoff]
        for lease in idle:
            self._seal_quietly(lease)

    def let_go(self) -> None:
        """This process stops appending here for now (its puts go to the other tier): its
        kept leases are given back and its last segment forgotten, so that its next put
        here starts a segment of its own. Appended to later, a segment would hold values
        older and newer than the ones put meanwhile into the other tier, and eviction,
        which is by segment, would then drop newer values before older ones."""
        with self._kept_lock:
            kept: list[Lease] = []
            if self._kept_pid == os.getpid():
                kept, self._kept = self._kept, []
        for lease in kept:
            self._seal_quietly(lease)
        self._last = None

    def holds_kept_lease(self) -> bool:
        """Whether this process keeps a lease here for its next put (one with room)."""
        with self._kept_lock:
            return self._kept_pid == os.getpid() and bool(self._kept)

    # -- taken ------------------------------------------------------------------------------

    def _new_lease(self, need: int, evict: bool = True, stamp: int | None = None) -> Lease | None:
        """A segment to append to (kept between puts): the most recently used one that
        nobody writes and that has room, else a never-used or emptied one, else (a tier
        that does not spill) the least recently used one nobody writes, emptied here: an
        index transaction. A spilling tier never empties one here: its cleaner keeps
        emptied ones ready (:mod:`.segment_cleaner`) and is woken whenever one is taken;
        nor does one with ``evict=False``. ``stamp``: the recency the lease's segment gets
        (:meth:`_leased`). None when no segment is ready, or live processes write every
        segment."""
        me = os.getpid()
        if self._still_dry():
            return None
        last = self._last  # the segment this process appended to last, as it left it
        if last is not None and stamp is None and last.end + need <= self.segment_bytes:
            gen = self.index.claim(last.seg, SegRow(last.gen, last.end, 0), me, empty=False)
            if gen is not None:  # untouched since: no scan of the segment table
                return self._leased(last.seg, gen, last.end, stamp=stamp)
        if self.spill is not None and stamp is None and is_beside_forward():
            # beside a forward: the scan and the claim run in the cleaner process, whose
            # py-lmdb calls give up no GIL of ours (.publish_channel)
            publisher = self.cleaner.publisher
            got = publisher.lease(need, me) if publisher is not None else None
            if got:
                seg, gen, end, ready = got
                return self._leased(seg, gen, end, ready=ready)
            if got is False:  # none ready there: the reserve ran dry
                return self._reserve_dry()
        for _attempt in range(16):
            rows = self.index.segments()
            free = self._free(rows, me)
            pick = self._pick(rows, free, need, self._appends(evict, stamp))
            if pick is not None:
                seg, row, ready = pick
                gen = self.index.claim(seg, row, me, empty=row is None)
                if gen is not None:
                    end = 0 if ready or row is None else row.end
                    return self._leased(seg, gen, end, ready=ready, stamp=stamp)
                continue
            if not free:
                break
            if self.spill is not None or not evict:
                break  # the reserve ran dry: skipped, never a spill on this thread
            tick, seg, row = min(free)
            if stamp is not None and tick > stamp:
                break  # a spill's values are older than any here: evicted, not these
            gen = self._empty(seg, row, remove=False)
            if gen is not None:
                return self._leased(seg, gen, 0, stamp=stamp)
        if self.spill is not None:
            return self._reserve_dry()
        if not evict:
            with self._lock:
                self.reserve_dry += 1
        return None

    def _reserve_dry(self) -> None:
        """A spilling tier found no segment ready: counted, its cleaner woken, and the next
        puts answer at once for a while (:meth:`_dry_again`)."""
        self._dry = (self._shared[0] + self._shared[1], time.monotonic() + DRY_RECHECK_S)
        self.cleaner.wake()
        return self._dry_again()

    def _free(self, rows: dict[int, SegRow], owner: int) -> list[tuple[int, int, SegRow]]:
        """(recency, segment, row) of the segments ``owner`` may take."""
        return [
            (self._ticks[seg], seg, row)
            for seg, row in rows.items()
            if seg < self.count and _takeable(row, owner)
        ]

    def _appends(self, evict: bool = True, stamp: int | None = None) -> bool:
        """Whether a lease may be a segment another lease left with room, appended to.

        Only in a tier that does not spill, for a put that may evict: a disk tier's own
        puts, not its spills or values written around the memory tier above it.
        Eviction is by segment, so the values of one segment must be of one age: a
        spill (``stamp``) appended to a segment holding newer values would take their
        recency, and a put appended to a spilled or written-around segment
        (``evict=False``), or to one of the memory tier left while this process wrote
        around it, would give older values its own."""
        return self.spill is None and evict and stamp is None

    def _pick(
        self,
        rows: dict[int, SegRow],
        free: list[tuple[int, int, SegRow]],
        need: int,
        appends: bool,
    ) -> tuple[int, SegRow | None, bool] | None:
        """The segment to claim, in order of choice: with ``appends`` the most recently
        used one with room for ``need`` bytes, else a never-used one, else one emptied
        ahead (the reserve): (segment, its row, or None for a never-used one, ready).
        None: none of those."""
        room = [f for f in free if appends and f[2].end and f[2].end + need <= self.segment_bytes]
        if room:
            _tick, seg, row = max(room)
            return seg, row, False
        fresh = next((s for s in range(self.count) if s not in rows), None)
        if fresh is not None:
            return fresh, None, True
        ready = [f for f in free if not f[2].end]
        if ready:
            _tick, seg, row = ready[0]
            return seg, row, True
        return None

    def claim_for(self, need: int, owner: int) -> tuple[int, int, int, bool] | None:
        """What :meth:`_new_lease` takes first, claimed for another process ``owner`` (its
        cleaner process runs this for its threads beside a forward): (segment,
        generation, end, ready), or None when none is ready."""
        for _attempt in range(16):
            rows = self.index.segments()
            pick = self._pick(rows, self._free(rows, owner), need, self._appends())
            if pick is None:
                return None
            seg, row, ready = pick
            gen = self.index.claim(seg, row, owner, empty=row is None)
            if gen is not None:
                return seg, gen, 0 if ready or row is None else row.end, ready
        return None

    def _still_dry(self) -> bool:
        """The reserve was found dry a moment ago and nothing was spilled since
        (:meth:`_dry_again`): counted as dry again, True."""
        dry = self._dry
        if dry is not None:
            if self._shared[0] + self._shared[1] == dry[0] and time.monotonic() < dry[1]:
                self._dry_again()
                return True
            self._dry = None
        return False

    def _dry_again(self) -> None:
        """A put that found the reserve dry: counted, and no segment. Until a cleaner has
        spilled again (the tier's shared spill counts change) or :data:`DRY_RECHECK_S`
        passed, the next puts answer so without reading the index: with the reserve dry,
        a scan of the segment table per put only took CPU time from the spills that
        refill it (measured: bench_stores, "two tiers", 4 processes)."""
        with self._lock:
            self.reserve_dry += 1

    def _leased(
        self, seg: int, gen: int, end: int, ready: bool = False, stamp: int | None = None
    ) -> Lease:
        """A new lease of ``seg``; ``ready``: one taken from the reserve (or never used),
        so the cleaner is woken to make another (a tier that spills). ``stamp``: the
        segment's recency from a spilled segment's (:meth:`adopt`), not now: the values
        keep their place in the recency order across the spill (an empty segment takes
        it, one holding values keeps the newer of the two)."""
        if stamp is None:
            self.touch(seg)
        else:
            self._ticks[seg] = stamp if end == 0 else max(stamp, self._ticks[seg])
        if ready and self.reserve:
            self.cleaner.wake()
        return Lease(seg, gen, end)

    def _takeable(self, row: SegRow) -> bool:
        return _takeable(row, os.getpid())

    # -- given back -------------------------------------------------------------------------

    def _seal(self, lease: Lease) -> None:
        self.index.release(lease.seg, lease.gen, os.getpid())
        self._sealed(lease)

    def _sealed(self, lease: Lease) -> None:
        """``lease`` was given back (by :meth:`_seal`, or in its last publish's
        transaction): remembered as this process left it."""
        self._last = Lease(lease.seg, lease.gen, lease.end)

    def _seal_quietly(self, lease: Lease) -> None:
        """Give ``lease`` back on a failure path (a full disk may refuse that too: then
        the segment is taken over once this process is gone)."""
        try:
            self._seal(lease)
        except StoreError as exc:
            self._warn.warning("seal", "%s tier: segment %d kept: %s", self.name, lease.seg, exc)


__all__ = ["DRY_RECHECK_S", "Lease", "TierLeases"]
