"""A tier's put path (:class:`TierWrites`, a part of :class:`~.tier.Tier`): whole batches
appended to a leased segment (no lock while the bytes are copied: the lease is
exclusive), each record framed on its way in, then the batch's keys published in one
index transaction.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    PIECE,
    copy_framed,
    copy_framed_many,
    make_header,
    write_framed_many,
)
from ucm_patch.hooks.stores.memcopy import copy_bytes
from ucm_patch.hooks.stores.publish_channel import is_beside_forward
from ucm_patch.hooks.stores.segment_cleaner import SegmentCleaner
from ucm_patch.hooks.stores.segment_files import FileSegments
from ucm_patch.hooks.stores.segment_index import LOC, SegmentIndex
from ucm_patch.hooks.stores.sidecar import sidecar
from ucm_patch.hooks.stores.tier_leases import Lease
from ucm_patch.hooks.stores.tier_records import FRAME_AT, RECORD_HEADER, Record, record_bytes

_PAD = bytes(FRAME_AT - 16)
_ZEROS = bytes(64)
_BLANK_HEADER = bytes(HEADER_SIZE)  # a frame header not written yet: reads as corrupt
#: A mapped segment's values copy on the sidecar from this size on. Below it the fused
#: copy (each piece hashed right after its copy, still in the cache) was as fast or faster
#: in bench_stores (1 MiB values); at 2 MiB the copy beside the checksum was faster.
MAPPED_SIDECAR_MIN = 8 * PIECE


def _file_parts(batch: Sequence[Record], headers: list[bytes]) -> list[bytes | memoryview]:
    """The ``pwritev`` buffers of ``batch`` in a file segment: per record its digest, the
    zero fill, ``headers[i]`` and the payload, padded to 64 bytes."""
    parts: list[bytes | memoryview] = []
    for (digest, _key, payload), header in zip(batch, headers, strict=True):
        parts += (digest, _PAD, header, payload)
        pad = -len(payload) & 63
        if pad:
            parts.append(_ZEROS[:pad])
    return parts


def _copy_each(copies: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in copies:
        copy_bytes(dst, src)


class TierWrites:
    """The put path of a :class:`~.tier.Tier`: its state (below) is set up by the tier's
    ``__init__``. Leases come from :class:`~.tier_leases.TierLeases`; a full disk is
    relieved by :meth:`~.tier_emptying.TierEmptying._relieve`."""

    name: str
    segment_bytes: int
    secret: bytes | None
    fsync: bool
    hash_beside: bool
    files: FileSegments
    index: SegmentIndex
    cleaner: SegmentCleaner

    def put(
        self, records: Sequence[Record], framed: bool = False, evict: bool = True
    ) -> list[bool]:
        """Append ``records`` (digest, key bytes, payload), or with ``framed`` (digest,
        frame header, payload); True per record stored (or already present), False where
        it is larger than a segment or every segment is being written by live processes.
        ``evict=False``: only into a segment with room or one ready (never used, or
        emptied ahead by a cleaner), never emptying one here; False where none is (a put
        written around the memory tier: :meth:`LocalStore._put`)."""
        limit = self.segment_bytes - RECORD_HEADER
        out = [len(p) <= limit for _d, _h, p in records]
        pending = [i for i, fits in enumerate(out) if fits]
        if not pending:
            return out
        lease = self._take_kept()
        relieved = False
        try:
            while pending:
                try:
                    lease, taken = self._append(lease, records, pending, framed, evict)
                except StoreError as exc:
                    lease = None  # _append gave it back
                    cause = exc.__cause__
                    if not isinstance(cause, OSError) or cause.errno != errno.ENOSPC or relieved:
                        raise
                    self._relieve(sum(record_bytes(len(records[i][2])) for i in pending), cause)
                    relieved = True
                    continue
                if not taken:  # no segment ready (being emptied, or live processes' leases)
                    for i in pending:
                        out[i] = False
                    break
                pending = pending[taken:]
        finally:
            if lease is not None:
                self._keep(lease, max(record_bytes(len(records[i][2])) for i in range(len(out))))
        return out

    def _append(
        self,
        lease: Lease | None,
        records: Sequence[Record],
        pending: list[int],
        framed: bool,
        evict: bool = True,
    ) -> tuple[Lease | None, int]:
        """Write and publish as many of ``pending`` as fit in ``lease`` (a new one when it
        has no room): (the lease, records done). StoreError on failure, caused by the
        OSError (ENOSPC included) of the segment or the index."""
        need = record_bytes(len(records[pending[0]][2]))
        if lease is None or lease.end + need > self.segment_bytes:
            if lease is not None:
                self._seal(lease)
            lease = self._new_lease(need, evict=evict)
            if lease is None:
                return None, 0
        self.files.new_batch()
        seg, gen, room = lease.seg, lease.gen, self.segment_bytes
        end = lease.end
        batch: list[Record] = []
        locs: list[tuple[bytes, bytes]] = []
        pack = LOC.pack
        size = 0
        for i in pending:
            record = records[i]
            n = len(record[2])
            size = (RECORD_HEADER + n + 63) & ~63
            if end + size > room:
                break
            batch.append(record)
            locs.append((record[0], pack(seg, gen, end, HEADER_SIZE + n)))
            end += size
        # No room left for a record like the next (or, the put done, like the last): the
        # segment is given back in the publish's own transaction, not in one of its own.
        # Beside vLLM's forward every index transaction costs GIL takes (py-lmdb gives the
        # GIL up in each call), and a writer that loses it inside one holds LMDB's writer
        # lock meanwhile, so one transaction fewer per segment is felt by every writer.
        full = end + size > room
        try:
            try:
                self._write(lease, batch, end, framed)
            except OSError as exc:
                self.files.cut(seg, lease.end)  # a partly written batch: space back
                where = self.files.where(seg)
                raise StoreError(f"{self.name} tier: cannot write {where!r}: {exc}") from exc
            if not self._publish(seg, gen, locs, lease.end, end, full):
                raise StoreError(f"{self.name} tier: lost segment {seg} mid-write")
            self.index.flush()
        except BaseException:
            self._seal_quietly(lease)
            raise
        lease.end = end
        self.touch(seg)
        if full:
            self._sealed(lease)
            return None, len(batch)
        return lease, len(batch)

    def _publish(
        self, seg: int, gen: int, locs: list[tuple[bytes, bytes]], start: int, end: int,
        release: bool,
    ) -> bool:  # fmt: skip
        """Publish a batch (:meth:`SegmentIndex.publish`): through the cleaner process from
        a thread beside a forward, where it has one that answers (:mod:`.publish_channel`:
        py-lmdb gives the GIL up per key), else here."""
        me = os.getpid()
        tried = False
        if is_beside_forward():
            publisher = self.cleaner.publisher
            if publisher is not None:
                done = publisher.publish(seg, gen, me, locs, start, end, release)
                if done is not None:
                    return done
                tried = True
        if self.index.publish(seg, gen, me, locs, start, end, release=release):
            return True
        # Not ours any more: lost, or the cleaner published it (and gave the segment back)
        # after we stopped waiting for its answer. Then every key has its entry.
        return tried and None not in self.index.lookup([digest for digest, _loc in locs])

    def _write(self, lease: Lease, batch: list[Record], end: int, framed: bool) -> None:
        """Write ``batch`` from ``lease.end`` on. A segment takes the whole batch in one
        native call where the row helper is built (:meth:`_write_framed_in_one_call`,
        :meth:`_write_file_in_one_call`). Otherwise a batch of large values (``PIECE`` for a file,
        :data:`MAPPED_SIDECAR_MIN` for a mapping) is copied on this thread's sidecar
        while their frames are computed here (:meth:`_write_hashing_meanwhile`), and
        otherwise a mapped segment gets each payload copied once and its frame computed on
        the copy (hot in the cache: the checksum costs no second trip to memory; a payload
        over ``PIECE`` piece by piece, so that it stays so), and a file segment gets one
        ``pwritev`` of the batch."""
        view = self.files.mapping(lease.seg, end, write=True)
        if view is not None and not framed and self._write_framed_in_one_call(lease, batch, view):
            return
        if view is None and not framed and self._write_file_in_one_call(lease, batch):
            if self.fsync:
                self.files.sync(lease.seg)
            return
        if not framed and min([len(r[2]) for r in batch]) >= (
            PIECE if view is None else MAPPED_SIDECAR_MIN
        ):
            self._write_hashing_meanwhile(lease, batch, view)
        elif view is not None:
            off = lease.end
            secret = self.secret
            for digest, key, payload in batch:
                at = off + RECORD_HEADER
                stop = at + len(payload)
                if framed:
                    copy_bytes(view[at:stop], payload)
                    header = key
                elif stop - at <= PIECE:  # copy_framed's first case, without its call
                    copy_bytes(view[at:stop], payload)
                    header = make_header(key, view[at:stop], secret)
                else:
                    header = copy_framed(key, view[at:stop], payload, secret)
                view[off:at] = digest + _PAD + header
                off = (stop + 63) & ~63
        else:
            secret = self.secret
            headers = [k if framed else make_header(k, p, secret) for _d, k, p in batch]
            self.files.write(lease.seg, lease.end, _file_parts(batch, headers))
        if view is None and self.fsync:
            self.files.sync(lease.seg)

    def _write_framed_in_one_call(self, lease: Lease, batch: list[Record], view: memoryview
                                  ) -> bool:  # fmt: skip
        """A batch into a mapped segment, every payload copied and framed in one native
        call (:func:`~.framing.copy_framed_many`: the GIL given up once per batch; beside
        vLLM's forward, a thread that keeps it, each give-up per value or piece waited up
        to the switch interval). False when that cannot be (a keyed store, no helper):
        nothing was written, the caller writes the batch its own way."""
        starts: list[int] = []
        copies: list[tuple[bytes, memoryview, memoryview | bytes]] = []
        off = lease.end
        for _digest, key, payload in batch:
            at = off + RECORD_HEADER
            starts.append(off)
            copies.append((key, view[at : at + len(payload)], payload))
            off = (at + len(payload) + 63) & ~63
        headers = copy_framed_many(copies, self.secret)
        if headers is None:
            return False
        for start, header, (digest, _key, _payload) in zip(starts, headers, batch, strict=True):
            view[start : start + RECORD_HEADER] = digest + _PAD + header
        return True

    def _write_file_in_one_call(self, lease: Lease, batch: list[Record]) -> bool:
        """A file segment's batch in one native call where the row helper is built
        (:func:`~.framing.write_framed_many`): each payload hashed and written piece by
        piece (or hashed on the process's checksum helper thread meanwhile, where
        ``hash_beside``), then its record header; False where it cannot (nothing
        written). Why not the sidecar (:meth:`_write_hashing_meanwhile`): that takes two
        threads per writer and reads each payload from memory twice; with several writers
        on a host of few cores (writes around a dry memory tier) the threads outnumber the
        cores."""
        entries = []
        off = lease.end
        for digest, key, payload in batch:
            entries.append((key, digest + _PAD, off, payload))
            off = (off + RECORD_HEADER + len(payload) + 63) & ~63
        fd = self.files.live_fd(lease.seg, create=True)[0]
        return write_framed_many(fd, entries, self.secret, beside=self.hash_beside)

    def _write_hashing_meanwhile(
        self, lease: Lease, batch: list[Record], view: memoryview | None
    ) -> None:
        """A batch of large values (:meth:`_write`): the payloads are copied on this
        thread's sidecar (into the mapping, or one ``pwritev`` into the file with blank
        frame headers) while the frame headers are computed here from the same source
        bytes; then the headers go into their places. The copy and the checksum both
        release the GIL, so on two cores the checksum costs no time of its own
        (:mod:`.sidecar`; one after the other it was a third of a disk put). Until its
        header is in, a record reads as corrupt; nobody reads it before the index
        publishes it, after this returns. A caller changing its buffer during the put
        gets a value that reads as corrupt (a miss), never other bytes."""
        seg, files = lease.seg, self.files
        starts: list[int] = []
        off = lease.end
        for _digest, _key, payload in batch:
            starts.append(off)
            off = (off + RECORD_HEADER + len(payload) + 63) & ~63
        side = sidecar()
        if view is None:
            parts = _file_parts(batch, [_BLANK_HEADER] * len(batch))
            side.start(files.write, seg, lease.end, parts)
        else:
            copies = [
                (view[at : at + len(r[2])], r[2])
                for at, r in zip([s + RECORD_HEADER for s in starts], batch, strict=True)
            ]
            side.start(_copy_each, copies)
        try:
            secret = self.secret
            headers = [make_header(key, payload, secret) for _digest, key, payload in batch]
        finally:
            side.join()  # the copy's OSError, if any, is raised here
        for start, header, (digest, _key, _payload) in zip(starts, headers, batch, strict=True):
            if view is None:
                files.write(seg, start + FRAME_AT, [header])
            else:
                view[start : start + RECORD_HEADER] = digest + _PAD + header


__all__ = ["MAPPED_SIDECAR_MIN", "TierWrites"]
