"""The local store's reads (:class:`LocalReads`, a part of :class:`~.local.LocalStore`):
presence, values as ``bytes``, into the caller's buffers, or page by page into a KV cache
(:meth:`~LocalReads.get_many_scattered`), each checked against its integrity frame; a
value that fails it is dropped from the index and counted, never served.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from xxhash import xxh3_128_digest

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    key_bytes,
    verify,
)
from ucm_patch.hooks.stores.scatter import Scatter, check_targets, set_marks
from ucm_patch.hooks.stores.segment_files import SegmentLost
from ucm_patch.hooks.stores.segment_index import Loc
from ucm_patch.hooks.stores.tier import Tier


def digest_of(kb: bytes) -> bytes:
    """The 16-byte index key of a store key (keys may hold any characters and length).

    XXH3-128, not a cryptographic hash: two keys with one digest cannot make the store
    serve a wrong value, because the frame's check covers the whole key; the later key
    is only a miss."""
    return xxh3_128_digest(kb)


class LocalReads(KVStore):
    """The read path of a :class:`~.local.LocalStore`: its state (below) is set up by the
    store's ``__init__``; the stats and closed flag are :class:`KVStore`'s."""

    path: str
    memory: Tier | None
    tiers: tuple[Tier, ...]
    _secret: bytes | None
    _warn: RateLimitedLog

    def _exists(self, digests: list[bytes]) -> list[bool]:
        found = [False] * len(digests)
        todo = list(range(len(digests)))
        for tier in self.tiers:
            if not todo:
                break
            locs = tier.lookup([digests[i] for i in todo])
            for i, loc in zip(todo, locs, strict=True):
                found[i] = loc is not None
            todo = [i for i in todo if not found[i]]
        return found

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence per key in either tier, from the shared indexes."""
        self._check_open()
        return self._exists([digest_of(key_bytes(k)) for k in keys])

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values per key; None when missing or corrupt (corrupt values are dropped)."""
        self._check_open()
        out: list[bytes | None] = [None] * len(keys)
        self._read(keys, None, out)
        return out

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each payload straight into the buffer of the same index (one copy from the
        segment), then verify it there. False for a missing or corrupt value or one whose
        size is not the buffer's."""
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError(f"get_many_into: {len(keys)} keys for {len(buffers)} buffers")
        out: list[bytes | None] = [None] * len(keys)
        views = [as_bytes_view(b) for b in buffers]
        self._read(keys, views, out)
        return [v is not None for v in out]

    def lookup_for_load(self, keys: Sequence[str]) -> list[Loc | None] | None:
        """Where the keys' values are in the memory tier (None each: not there), for a
        :meth:`get_many_scattered` soon after (its ``located``): one index transaction.
        None without a memory tier."""
        self._check_open()
        if self.memory is None:
            return None
        return self.memory.lookup([digest_of(key_bytes(k)) for k in keys])

    def get_many_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Scatter],
        marks: Sequence[tuple[int, int]] = (),
        flags: Any = None,
        located: Sequence[Any] | None = None,
    ) -> list[bool]:
        """Write each value's pages where its target says, straight from the segment it
        is in (the memory tier: every value of a call in one native call, checksum fused,
        :func:`~.framing.scatter_verified_many`), then check the segment still holds it;
        False for a value missing, corrupt, not the target's size, or whose segment was
        emptied meanwhile (its pages were written then, and hold nothing usable).

        ``marks`` (end index in ``keys``, flag index) into ``flags``, a ctypes ``uint8``
        array: each flag set once the values before its end are written (rows of a KV
        cache, waited for one by one by the forward), all of them by the return. The
        values not in the memory tier are done first (read from the disk tier), so that
        a set flag means every value before its end is written; their checks after.
        ``located``: the keys' :meth:`lookup_for_load`, made earlier (by the thread that
        holds the GIL anyway: vLLM's forward, in ``start_load_kv``)."""
        self._check_open()
        check_targets(keys, targets)
        out: list[bytes | None] = [None] * len(keys)
        memory = self.memory
        if not marks or memory is None:
            try:
                self._read(keys, None, out, targets)
            finally:
                set_marks(marks, flags)
            return [v is not None for v in out]
        try:
            locs = located if located is not None else self.lookup_for_load(keys)
            if locs is None or len(locs) != len(keys):
                raise ValueError(f"get_many_scattered: {len(keys)} keys, located {locs!r:.40}")
        except BaseException:
            set_marks(marks, flags)
            raise
        rest = [i for i, loc in enumerate(locs) if loc is None]
        first = [i for i, loc in enumerate(locs) if loc is not None]
        try:
            if rest:  # the disk tier's (or nowhere): before any row is marked done
                sub: list[bytes | None] = [None] * len(rest)
                self._read([keys[i] for i in rest], None, sub, [targets[i] for i in rest])
                for i, v in zip(rest, sub, strict=True):
                    out[i] = v
            # marks counted in the memory tier's values: how many of them precede each end
            before = [0] * (len(keys) + 1)
            for i, loc in enumerate(locs):
                before[i + 1] = before[i] + (loc is not None)
            sub = [None] * len(first)
            self._read([keys[i] for i in first], None, sub, [targets[i] for i in first],
                       [(before[end], flag) for end, flag in marks], flags,
                       [locs[i] for i in first])  # fmt: skip
            for i, v in zip(first, sub, strict=True):
                out[i] = v
        finally:
            set_marks(marks, flags)
        return [v is not None for v in out]

    def _read(
        self,
        keys: Sequence[str],
        into: list[memoryview] | None,
        out: list[bytes | None],
        targets: Sequence[Scatter] | None = None,
        marks: Sequence[tuple[int, int]] = (),
        flags: Any = None,
        located: Sequence[Loc | None] | None = None,
    ) -> None:
        kbs = [key_bytes(k) for k in keys]
        todo = list(range(len(keys)))
        hits = corrupt = nbytes = memory_hits = 0
        try:
            for tier in self.tiers:
                if not todo:
                    break
                if located is not None and tier is self.memory:  # looked up by the caller
                    tier.files.new_batch()
                    locs = [located[i] for i in todo]
                else:
                    # digests made per tier asked, not up front: a load's values were
                    # looked up by the caller, and its read needs none of them
                    locs = tier.lookup([digest_of(kbs[i]) for i in todo])
                got: list[tuple[int, Loc, bytes]] = []
                found = [(i, loc) for i, loc in zip(todo, locs, strict=True) if loc is not None]
                if into is not None:  # into buffers: every value of the tier in one call
                    fits = [(i, loc) for i, loc in found if loc.size - HEADER_SIZE == len(into[i])]
                    reads = [(loc, kbs[i], into[i]) for i, loc in fits]
                    for (i, loc), why in zip(fits, tier.read_verified_many(reads), strict=True):
                        if why is None:
                            got.append((i, loc, b""))
                            continue
                        self._say_corrupt(tier, kbs[i], why)
                        corrupt += self._corrupt(tier, digest_of(kbs[i]), loc, keys[i])
                    found = []  # a value of another size is a miss, never corrupt
                elif targets is not None:  # into another memory: the same, page by page
                    fits = [(i, loc) for i, loc in found
                            if loc.size - HEADER_SIZE == targets[i].nbytes]  # fmt: skip
                    scattered = [(loc, kbs[i], targets[i]) for i, loc in fits]
                    # the marks go with the first tier's call (get_many_scattered)
                    order = [i for i, _l in fits]  # ascending, as ``todo``
                    ends = [(bisect_left(order, end), flag) for end, flag in marks]
                    results = tier.read_scattered_many(scattered, ends, flags)
                    for (i, loc), why in zip(fits, results, strict=True):
                        if why is None:
                            got.append((i, loc, b""))
                            continue
                        self._say_corrupt(tier, kbs[i], why)
                        corrupt += self._corrupt(tier, digest_of(kbs[i]), loc, keys[i])
                    found = []
                for i, loc in found:
                    value = self._read_one(tier, loc, kbs[i])
                    if value is not None:
                        got.append((i, loc, value))
                    else:
                        corrupt += self._corrupt(tier, digest_of(kbs[i]), loc, keys[i])
                current = tier.index.current([loc for _i, loc, _v in got])
                used: set[int] = set()
                for (i, loc, value), ok in zip(got, current, strict=True):
                    if ok:  # else the segment was emptied while we read: a miss
                        out[i] = value
                        used.add(loc.seg)
                        nbytes += loc.size - HEADER_SIZE
                        hits += 1
                        memory_hits += tier is self.memory
                for seg in used:
                    tier.touch(seg)
                todo = [i for i in todo if out[i] is None]
                if marks:  # rows marked done: a value not written by now is a miss, never
                    break  # written later behind a reader that already took the row
        except (OSError, SegmentLost) as exc:
            self._count(errors=1)
            raise StoreError(f"local store {self.path!r}: cannot read: {exc}") from exc
        self._count(
            gets=len(keys),
            hits=hits,
            misses=len(keys) - hits,
            corrupt=corrupt,
            bytes_read=nbytes,
            memory_hits=memory_hits,
            disk_hits=hits - memory_hits,
        )

    def _read_one(self, tier: Tier, loc: Loc, kb: bytes) -> bytes | None:
        """The value at ``loc`` checked against ``kb``, as new bytes; None when corrupt or
        lost."""
        try:
            head, payload = tier.read(loc)
            verify(kb, head, payload, self._secret)
            return payload
        except (CorruptValue, SegmentLost) as exc:
            self._say_corrupt(tier, kb, exc)
            return None

    def _say_corrupt(self, tier: Tier, kb: bytes, why: Exception) -> None:
        self._warn.warning(
            "corrupt", "local store: dropped corrupt value %r in %s: %s", kb, tier.path, why
        )

    def _corrupt(self, tier: Tier, digest: bytes, loc: Loc, key: str) -> int:
        """Drop a value that failed its check, unless its segment was emptied meanwhile
        (then it is an ordinary miss): 1 when it counted as corrupt."""
        if not tier.index.current([loc])[0]:
            return 0
        tier.index.drop(digest, loc)
        return 1
