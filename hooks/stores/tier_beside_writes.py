"""A spilling tier's put from a thread beside a forward (:class:`TierBesideWrites`, a
part of :class:`~.tier.Tier`): the whole put in one native copy and one request to the
tier's cleaner process, however many segments it spans.

Why: beside vLLM's forward, a thread that keeps the GIL, every time a dump thread gives
the GIL up for something that takes a while (a copy of megabytes, a wait for another
process's answer) it waits up to the switch interval to get it back. The put path of
:class:`~.tier_writes.TierWrites` does, per segment a put spans, a copy, a publish and,
for the next segment, a lease: about five such waits for a put of a segment and a bit.
Here the put's leases come first (those the process keeps, those asked for when the
step started, :meth:`TierBesideWrites.expect_puts`, else one request for all it needs),
its values are copied and framed into every segment in one native call, and its
publishes (each full segment given back in its own) go in one request, which also asks,
once this put filled a segment, for leases with room for a put like it (at most
:func:`spare_segments`), kept for the next. A put then waits twice: its copy and its
publish.

Anything the channel cannot do (no cleaner process serving, an answer given up on, no
native helper) is left to :meth:`TierWrites.put`, which does it the usual way.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Sequence

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    SendPlan,
    copy_framed_many,
    copy_framed_send,
)
from ucm_patch.hooks.stores.memcopy import address
from ucm_patch.hooks.stores.publish_channel import (
    MOST,
    Answer,
    Fragment,
    PublishClient,
    is_beside_forward,
)
from ucm_patch.hooks.stores.rowcopy import WORD
from ucm_patch.hooks.stores.segment_index import LOC
from ucm_patch.hooks.stores.tier_leases import Lease
from ucm_patch.hooks.stores.tier_records import FRAME_AT, RECORD_HEADER, Record, record_bytes
from ucm_patch.hooks.stores.tier_writes import TierWrites

_PAD = bytes(FRAME_AT - 16)
#: Most segments a put asks to keep leased for the next one (room for a put like itself):
#: a put that finds none kept pays a request for its leases, one more GIL take beside the
#: forward; the segments kept are ones the reserve would hold ready anyway. This many
#: always, and up to half the tier's reserve (:func:`spare_segments`).
SPARE_SEGMENTS = 2


def spare_segments(reserve: int) -> int:
    """Most segments a put keeps leased for the next one, in a tier whose cleaner keeps
    ``reserve`` empty segments ready: :data:`SPARE_SEGMENTS`, or half the reserve where
    that is more, so that one process never takes the reserve from the others.

    Why more than 2 where the tier is large: a step's dumps of a long prefill are one put
    of several segments per dump thread (900 values of 1 MiB over two threads: 8 segments
    of 64 MiB each). With 2 kept, every such put asked for the other 6 first, and beside
    vLLM's forward that request's answer cost a GIL take, up to the switch interval,
    before the copy began (docs/CONNECTOR.md, "Leases kept for a put like the last", has
    the figures)."""
    return max(SPARE_SEGMENTS, reserve // 2)


class _Part:
    """The records of a put that go into one lease: ``first`` to ``stop`` of the put's
    pending ones, from the lease's end to ``end``; ``full``: no room is left for a record
    like the next (or the last), so the publish gives the segment back."""

    __slots__ = ("end", "first", "full", "lease", "stop")

    def __init__(self, lease: Lease, first: int, stop: int, end: int, full: bool) -> None:
        self.lease, self.first, self.stop, self.end, self.full = lease, first, stop, end, full


def _plan(leases: Sequence[Lease], sizes: Sequence[int], room: int) -> list[_Part]:
    """The records of ``sizes`` (record bytes, in order) placed into ``leases`` in turn:
    each lease takes records while they fit, in the order given."""
    parts: list[_Part] = []
    i, n = 0, len(sizes)
    for lease in leases:
        end, first = lease.end, i
        while i < n and end + sizes[i] <= room:
            end += sizes[i]
            i += 1
        nxt = sizes[i] if i < n else sizes[-1]
        parts.append(_Part(lease, first, i, end, end + nxt > room))
    return parts


def _segments_for(sizes: Sequence[int], room: int) -> int:
    """How many empty segments the records of ``sizes`` fill, in order."""
    count, end = 0, room
    for size in sizes:
        if end + size > room:
            count, end = count + 1, 0
        end += size
    return count


class TierBesideWrites(TierWrites):
    """:meth:`put` for threads beside a forward (:func:`.publish_channel.is_beside_forward`)
    into a tier that spills; every other put is :meth:`TierWrites.put`'s."""

    def put(
        self, records: Sequence[Record], framed: bool = False, evict: bool = True
    ) -> list[bool]:
        publisher = None
        if self.spill is not None and not framed and self.secret is None and is_beside_forward():
            publisher = self.cleaner.publisher
        if publisher is None or publisher.broken or not records:
            return super().put(records, framed, evict)
        limit = self.segment_bytes - RECORD_HEADER
        out = [len(p) <= limit for _d, _h, p in records]
        pending = [i for i, fits in enumerate(out) if fits]
        if pending:
            rest = self._put_beside(publisher, records, pending, out)
            if rest:
                for i, ok in zip(rest, super().put([records[i] for i in rest]), strict=True):
                    out[i] = ok
        return out

    def expect_puts(self, values: int, nbytes: int, puts: int) -> None:
        """``values`` values of ``nbytes`` in all follow, in about ``puts`` puts from
        threads beside the forward (a step's dumps, told by the forward's thread when the
        step starts): one lease request for the segments they need beyond the leases
        this process keeps (at most the tier's reserve), sent now and never waited for.
        Its answer is kept by the first put that finds it there (:meth:`_take_ahead`).

        Why: a put that finds no lease kept asks for its own first, and beside the
        forward that request's answer costs its thread a GIL take, up to the switch
        interval, before its copy can begin; a process gives its kept leases back after
        an idle second, so the first step after one pays this in every dump thread. Sent
        with the step's start, the answer is usually there when the first put looks.
        Nothing is sent where the beside put would not ask the channel either."""
        if values <= 0 or nbytes <= 0 or self.spill is None or self.secret is not None:
            return
        dry = self._dry
        if self._ahead is not None or (dry is not None and time.monotonic() < dry[1]):
            return  # one asked already, its answer not taken; or the reserve ran dry
        # this thread's own channel: a dump thread that shares it (more threads than
        # channels) publishes itself while the answer is owed
        publisher = self.cleaner.publisher
        if publisher is None:
            return
        size = record_bytes(-(-nbytes // values))
        per = self.segment_bytes // size
        if per < 1:
            return
        puts = max(1, min(puts, values))
        share = -(-values // puts)
        # one more: the first segment claimed may be one given back with values in it
        # (the most recently used with room is claimed before a ready one)
        need = puts * -(-share // per) + 1
        with self._kept_lock:
            kept = len(self._kept) if self._kept_pid == os.getpid() else 0
        want = min(need - kept, self.reserve, MOST)
        if want > 0 and publisher.send_ahead(os.getpid(), size, want):
            self._ahead = (os.getpid(), publisher)

    def _put_beside(
        self, publisher: PublishClient, records: Sequence[Record], pending: list[int],
        out: list[bool],
    ) -> list[int]:  # fmt: skip
        """Put ``records[pending]`` through one copy and one request (:mod:`this module
        <.tier_beside_writes>`), marking ``out`` False for those skipped (the reserve ran
        dry): the ones left to :meth:`TierWrites.put` (the channel could not answer)."""
        me, room = os.getpid(), self.segment_bytes
        sizes = [record_bytes(len(records[i][2])) for i in pending]
        self._take_ahead(sizes[0])  # leases asked for at the step's start, if there
        leases: list[Lease] = []
        parts: list[_Part] = []
        placed = 0
        while placed < len(sizes):
            lease = self._take_kept()
            if lease is None:
                break
            leases.append(lease)
            parts = _plan(leases, sizes, room)
            placed = parts[-1].stop
        left: list[int] = []
        skipped: list[int] = []
        for _round in range(4):  # a lease with some room takes only some: ask again
            if placed == len(sizes):
                break
            if self._still_dry():
                skipped = pending[placed:]
                break
            want = min(_segments_for(sizes[placed:], room), MOST)
            answer = publisher.request(me, need=sizes[placed], leases=want)
            if answer is None:
                break
            for seg, gen, end, ready in answer.leases:
                leases.append(self._leased(seg, gen, end, ready=ready))
            parts = _plan(leases, sizes, room)
            placed = parts[-1].stop if parts else 0
            if placed < len(sizes) and answer.dry:
                self._reserve_dry()
                skipped = pending[placed:]
                break
            if not answer.leases:  # a claim failed there (logged): the usual way
                break
        if placed < len(sizes) and not skipped:
            left = pending[placed:]
        for i in skipped:
            out[i] = False
        if not placed:
            for lease in leases:
                self._keep(lease, sizes[0])
            return left
        if not self._write_and_publish(publisher, records, pending, parts, sizes[-1]):
            self._write_parts(records, pending, parts)
            self._publish_parts(publisher, records, pending, parts, sizes[-1])
        return left

    def _write_and_publish(
        self, publisher: PublishClient, records: Sequence[Record], pending: list[int],
        parts: list[_Part], last: int,
    ) -> bool:  # fmt: skip
        """The put's copy and its publish request in one native call
        (:func:`~.framing.copy_framed_send`): every record copied, framed and its header
        written, then the request sent and its answer waited for, so that this thread
        takes the GIL back once, when the answer is there. False when that cannot be (no
        native helper, a buffer without an address, the channel not taking requests):
        nothing was done, the caller copies and publishes the usual way."""
        secret = self.secret
        try:
            plan = self._send_plan(records, pending, parts)
            sent, spare = self._fragments(records, pending, parts)

            def work(request: bytes, request_fd: int, answer_fd: int, timeout_s: float
                     ) -> tuple[bool, bool] | None:  # fmt: skip
                return copy_framed_send(plan, request, request_fd, answer_fd, timeout_s,
                                        secret)  # fmt: skip

            ran, answer = publisher.request_after(work, os.getpid(), [f for _p, f in sent],
                                                  need=last, leases=spare)  # fmt: skip
        except BaseException:
            self._give_back(parts)
            raise
        if not ran:
            return False
        self._settle(parts, sent, answer, last)
        return True

    def _send_plan(self, records: Sequence[Record], pending: list[int], parts: list[_Part]
                   ) -> SendPlan:  # fmt: skip
        """Where each placed record goes (:meth:`_placed`), as addresses
        (:class:`~.framing.SendPlan`): each part's mapping asked for its address once,
        each record's place added to it."""
        keys: list[bytes] = []
        payloads: list[memoryview | bytes] = []
        leads: list[bytes] = []
        dst_at = array(WORD)
        held: list[memoryview] = []
        base = 0
        for view, at, (digest, key, payload) in self._placed(records, pending, parts):
            if not held or view is not held[-1]:
                found = address(view)
                if found is None:  # a spilling tier is mapped, and writable
                    raise StoreError(f"{self.name} tier: a segment's mapping is not writable")
                base = found
                held.append(view)
            keys.append(key)
            payloads.append(payload)
            leads.append(digest + _PAD)
            dst_at.append(base + at)
        return SendPlan(keys, payloads, leads, dst_at, held)

    def _placed(self, records: Sequence[Record], pending: list[int], parts: list[_Part]
                ) -> list[tuple[memoryview, int, Record]]:  # fmt: skip
        """Where each placed record goes, in order: its segment's mapping (a new batch
        of them), where its payload starts there, the record. Every record of a part
        ends by the part's end, checked against the mapping before anything is copied
        (:meth:`_send_plan`'s copy is by address). StoreError when one does not."""
        self.files.new_batch()
        out: list[tuple[memoryview, int, Record]] = []
        for part in parts:
            if part.stop == part.first:
                continue
            view = self.files.mapping(part.lease.seg, part.end, write=True)
            assert view is not None  # a spilling tier is mapped
            off = part.lease.end
            for i in pending[part.first : part.stop]:
                record = records[i]
                at = off + RECORD_HEADER
                out.append((view, at, record))
                off = (at + len(record[2]) + 63) & ~63
            if off > min(part.end, len(view)):
                raise StoreError(f"{self.name} tier: records of segment {part.lease.seg} end "
                                 f"at {off}, past its part ({part.end}) or mapping "
                                 f"({len(view)})")  # fmt: skip
        return out

    def _write_parts(self, records: Sequence[Record], pending: list[int], parts: list[_Part]
                     ) -> None:  # fmt: skip
        """Copy and frame every placed record into its lease's segment: one native call
        for all of them, else part by part the usual way (:meth:`TierWrites._write`)."""
        try:
            placed = self._placed(records, pending, parts)
            copies = [(key, view[at : at + len(payload)], payload)
                      for view, at, (_digest, key, payload) in placed]  # fmt: skip
            heads = [(view, at - RECORD_HEADER, digest) for view, at, (digest, _k, _p) in placed]
            headers = copy_framed_many(copies, self.secret)
            if headers is None:  # no native helper: part by part
                for part in parts:
                    if part.stop > part.first:
                        batch = [records[i] for i in pending[part.first : part.stop]]
                        self._write(part.lease, batch, part.end, False)
                return
            for (view, start, digest), header in zip(heads, headers, strict=True):
                view[start : start + RECORD_HEADER] = digest + _PAD + header
        except BaseException as exc:
            self._give_back(parts)
            if isinstance(exc, OSError):
                raise StoreError(f"{self.name} tier: cannot write: {exc}") from exc
            raise

    def _give_back(self, parts: list[_Part]) -> None:
        """A put that failed before its publish gives its leases back (sealed): a process
        that will never write them must not keep them leased."""
        for part in parts:
            self._seal_quietly(part.lease)

    def _fragments(
        self, records: Sequence[Record], pending: list[int], parts: list[_Part]
    ) -> tuple[list[tuple[_Part, Fragment]], int]:
        """The publish of every part that took records or is full (a full one given back
        in its publish), and the leases to ask for with them: once a segment was filled,
        room for a put like this one (at most :func:`spare_segments`), kept for the
        next."""
        pack = LOC.pack
        sent: list[tuple[_Part, Fragment]] = []
        for part in parts:
            seg, gen, end = part.lease.seg, part.lease.gen, part.lease.end
            if part.stop == part.first and not part.full:
                continue
            locs = []
            for i in pending[part.first : part.stop]:
                digest, _key, payload = records[i]
                locs.append((digest, pack(seg, gen, end, HEADER_SIZE + len(payload))))
                end = (end + RECORD_HEADER + len(payload) + 63) & ~63
            sent.append((part, (seg, gen, part.lease.end, part.end, part.full, locs)))
        spare = 0
        if any(p.full for p in parts):  # room for a put like this one, kept ahead
            wrote = sum([p.end - p.lease.end for p in parts])
            room = 0 if parts[-1].full else self.segment_bytes - parts[-1].end
            spare = min(spare_segments(self.reserve), -(-(wrote - room) // self.segment_bytes))
        return sent, spare

    def _publish_parts(
        self, publisher: PublishClient, records: Sequence[Record], pending: list[int],
        parts: list[_Part], last: int,
    ) -> None:  # fmt: skip
        """Publish every part in one request (:meth:`_fragments`); the writer publishes
        itself when the channel cannot."""
        sent, spare = self._fragments(records, pending, parts)
        answer = publisher.request(os.getpid(), [f for _p, f in sent], need=last, leases=spare)
        self._settle(parts, sent, answer, last)

    def _settle(
        self, parts: list[_Part], sent: list[tuple[_Part, Fragment]], answer: Answer | None,
        last: int,
    ) -> None:  # fmt: skip
        """After the request of ``sent``: each publish the channel did not answer is done
        here (as :meth:`TierWrites._publish` does); a part published is kept (or given
        back when full), one lost is sealed; a lease that took nothing is kept as it was,
        and the leases answered are kept for the next put."""
        me = os.getpid()
        published: list[bool | None] = [None] * len(sent)
        if answer is not None:
            published = list(answer.published)
        in_request = {id(p) for p, _f in sent}
        for part in parts:
            if id(part) not in in_request:
                self._keep(part.lease, last)
        lost = []
        for at, ((part, (seg, gen, start, end, release, locs)), done) in enumerate(
            zip(sent, published, strict=True)
        ):
            if done is None:  # the channel could not: here, as TierWrites._publish does
                try:
                    done = self.index.publish(seg, gen, me, locs, start, end, release=release)
                    done = done or None not in self.index.lookup([d for d, _loc in locs])
                except BaseException:
                    for later, _fragment in sent[at:]:
                        self._seal_quietly(later.lease)
                    raise
            if not done:
                lost.append(seg)
                self._seal_quietly(part.lease)
                continue
            part.lease.end = part.end
            self.touch(seg)
            if part.full:
                self._sealed(part.lease)
            else:
                self._keep(part.lease, last)
        for seg, gen, end, ready in answer.leases if answer is not None else ():
            self._keep(self._leased(seg, gen, end, ready=ready), last)
        if lost:
            raise StoreError(f"{self.name} tier: lost segment {lost[0]} mid-write")


__all__ = ["SPARE_SEGMENTS", "TierBesideWrites", "spare_segments"]
