"""The record layout of a tier's segments, and the shapes values take between tiers.

Record layout in a segment (64-byte aligned, so payloads are too)::

    digest 16 B | 28 B unused | frame header 20 B | payload | pad to 64 B

The frame header (:mod:`~ucm_patch.hooks.stores.framing`) checksums the key and payload,
so the index never needs to be trusted for content: a stale or forged location reads as
corrupt, never as a value.
"""

from __future__ import annotations

from collections.abc import Callable

from ucm_patch.hooks.stores.framing import HEADER_SIZE

RECORD_HEADER = 64  # digest, zero fill, frame header: the payload starts 64-byte aligned
FRAME_AT = RECORD_HEADER - HEADER_SIZE  # where the frame (header + payload) starts
#: A value: its key digest, its key's bytes (or, spilled, its frame header) and payload.
Record = tuple[bytes, bytes, memoryview]
#: Where a live value lies in its segment: (key digest, record offset, frame bytes).
Held = tuple[bytes, int, int]
#: Takes a segment being emptied: its records from offset 0 to the end of the last live
#: one, the live ones among them (:meth:`~.tier_emptying.TierEmptying.adopt` writes them
#: in one copy), and the segment's last use (its place in the recency order, which the
#: copy keeps). False: not taken, the values being older than all the tier below holds
#: (evicted by the recency order).
Spill = Callable[[memoryview, list[Held], int], bool]


def record_bytes(payload: int) -> int:
    return (RECORD_HEADER + payload + 63) & ~63


def segment_for(value_bytes: int) -> int:
    """The smallest segment (whole 4 KiB pages) that holds one value of ``value_bytes``."""
    return max(4096, (record_bytes(value_bytes) + 4095) & ~4095)


__all__ = ["FRAME_AT", "RECORD_HEADER", "Held", "Record", "Spill", "record_bytes", "segment_for"]
