"""A tier's read path (:class:`TierReads`, a part of :class:`~.tier.Tier`): keys looked
up in the index, their bytes copied (or scattered into pages) and verified against their
frames; whether the segment was emptied meanwhile is the caller's to ask the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    copy_verified,
    copy_verified_many,
    scatter_verified_many,
    verify,
)
from ucm_patch.hooks.stores.scatter import Scatter
from ucm_patch.hooks.stores.segment_files import FileSegments, SegmentLost
from ucm_patch.hooks.stores.segment_index import Loc, SegmentIndex
from ucm_patch.hooks.stores.tier_records import FRAME_AT, RECORD_HEADER


class TierReads:
    """The read path of a :class:`~.tier.Tier`: its state (below) is set up by the tier's
    ``__init__``."""

    secret: bytes | None
    files: FileSegments
    index: SegmentIndex

    def lookup(self, digests: Sequence[bytes]) -> list[Loc | None]:
        """Current locations; starts a batch (each segment file is checked once in it)."""
        self.files.new_batch()
        return self.index.lookup(digests)

    def read_verified(self, loc: Loc, key: bytes, payload: memoryview) -> None:
        """Copy the payload at ``loc`` into ``payload`` and verify it there against its
        frame for ``key`` (CorruptValue when it fails or the file is short, SegmentLost
        when the file is gone). Mapped: checksummed piece by piece as it is copied."""
        at = loc.offset + RECORD_HEADER
        view = self.files.mapping(loc.seg, loc.offset + FRAME_AT + loc.size)
        if view is not None:
            src = view[at : at + len(payload)]
            copy_verified(key, view[loc.offset + FRAME_AT : at], payload, src, self.secret)
            return
        header = bytearray(HEADER_SIZE)
        self.files.read_into(loc.seg, loc.offset + FRAME_AT, [memoryview(header), payload])
        verify(key, header, payload, self.secret)

    def read_verified_many(
        self, reads: Sequence[tuple[Loc, bytes, memoryview]]
    ) -> list[CorruptValue | SegmentLost | None]:
        """:meth:`read_verified` of each (loc, key, payload): None per value read and
        verified, else why not. A mapped tier copies and verifies them all in one call
        (:func:`~.framing.copy_verified_many`)."""
        out: list[CorruptValue | SegmentLost | None] = [None] * len(reads)
        entries: list[tuple[bytes, memoryview, memoryview, memoryview]] = []
        where: list[int] = []
        for i, (loc, key, payload) in enumerate(reads):
            try:
                view = self.files.mapping(loc.seg, loc.offset + FRAME_AT + loc.size)
                if view is None:
                    self.read_verified(loc, key, payload)
                    continue
            except (CorruptValue, SegmentLost) as exc:
                out[i] = exc
                continue
            at = loc.offset + RECORD_HEADER
            entries.append(
                (key, view[loc.offset + FRAME_AT : at], payload, view[at : at + len(payload)])
            )
            where.append(i)
        for i, why in zip(where, copy_verified_many(entries, self.secret), strict=True):
            out[i] = why
        return out

    def read_scattered_many(
        self,
        reads: Sequence[tuple[Loc, bytes, Scatter]],
        marks: Sequence[tuple[int, int]] = (),
        flags: Any = None,
    ) -> list[CorruptValue | SegmentLost | None]:
        """Each (loc, key, target): the value's pages written where ``target`` says and
        verified, None per value done, else why not. A mapped tier does them all from its
        segments in one call (:func:`~.framing.scatter_verified_many`); any other reads
        each value first. ``marks`` (end in ``reads``, flag) into ``flags``: set as the
        reads before each end are done, all of them by the return."""
        out: list[CorruptValue | SegmentLost | None] = [None] * len(reads)
        entries: list[tuple[bytes, memoryview, memoryview, Scatter]] = []
        where: list[int] = []
        ends: list[int] = []  # entries made from reads[:i], per i
        for i, (loc, key, target) in enumerate(reads):
            ends.append(len(entries))
            try:
                view = self.files.mapping(loc.seg, loc.offset + FRAME_AT + loc.size)
                if view is None:
                    head, body = self.read(loc)
                    entries.append((key, memoryview(head), memoryview(body), target))
                else:
                    at = loc.offset + RECORD_HEADER
                    n = loc.size - HEADER_SIZE
                    entries.append((key, view[loc.offset + FRAME_AT : at], view[at : at + n],
                                    target))  # fmt: skip
            except (CorruptValue, SegmentLost) as exc:
                out[i] = exc
                continue
            where.append(i)
        ends.append(len(entries))
        at_entries = [(ends[end], flag) for end, flag in marks]
        done = scatter_verified_many(entries, self.secret, at_entries, flags)
        for i, why in zip(where, done, strict=True):
            out[i] = why
        return out

    def read(self, loc: Loc) -> tuple[bytes, bytes]:
        head = self.files.read(loc.seg, loc.offset + FRAME_AT, HEADER_SIZE)
        body = self.files.read(loc.seg, loc.offset + RECORD_HEADER, loc.size - HEADER_SIZE)
        return head, body


__all__ = ["TierReads"]
