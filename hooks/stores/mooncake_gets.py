"""The Mooncake store's reads (:class:`MooncakeGets`, a part of
:class:`~.mooncake.MooncakeStore`): ``batch_get_into`` a registered staging buffer, the
frame checked there, each value then kept as ``bytes``, copied into the caller's buffer or
scattered page by page into a KV cache; a value whose size exceeds the slot guessed is
read again at its exact size, a corrupt one removed and counted, never served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    key_bytes,
    verify,
)
from ucm_patch.hooks.stores.mooncake_buffers import MooncakeBuffers, RegisteredBuffer
from ucm_patch.hooks.stores.mooncake_codes import INVALID_PARAMS, MISS, SAFE_GET, code_name
from ucm_patch.hooks.stores.scatter import Scatter, check_targets, scatter_from, set_marks

#: The store's logger (:mod:`.mooncake`'s): its lines keep the name users filter on.
log = logging.getLogger("ucm_patch.hooks.stores.mooncake")

#: ``take(index, checked payload view) -> bytes kept, or -1 when refused`` (see _read_many).
_Take = Callable[[int, memoryview], int]


class MooncakeGets(MooncakeBuffers):
    """The read path of a :class:`~.mooncake.MooncakeStore`, through its registered
    buffers: its state (below) is set up by the store's ``__init__``."""

    _secret: bytes | None
    _slot: int

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values via ``batch_get_into``; None when missing or failing the frame check."""
        out: list[bytes | None] = [None] * len(keys)

        def take(i: int, payload: memoryview) -> int:
            out[i] = bytes(payload)
            return len(payload)

        self._read_many(keys, take)
        return out

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each value's payload into the buffer of the same index: ``batch_get_into``
        a registered staging buffer, verify the frame there, one copy into ``buffers``
        (no ``bytes`` per value). False when missing, corrupt or not that buffer's size."""
        if len(keys) != len(buffers):
            raise ValueError(f"get_many_into: {len(keys)} keys for {len(buffers)} buffers")
        out = [False] * len(keys)
        views = [as_bytes_view(b) for b in buffers]

        def take(i: int, payload: memoryview) -> int:
            dst = views[i]
            if len(payload) != len(dst):
                return -1  # a value of another size: not this buffer's
            dst[:] = payload
            out[i] = True
            return len(payload)

        self._read_many(keys, take)
        return out

    def get_many_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Scatter],
        marks: Sequence[tuple[int, int]] = (),
        flags: Any = None,
        located: Any = None,
    ) -> list[bool]:
        """Each value's pages written where its target says, from the registered staging
        buffer its frame was checked in (one copy per byte, no ``bytes`` per value)."""
        check_targets(keys, targets)
        out = [False] * len(keys)

        def take(i: int, payload: memoryview) -> int:
            if len(payload) != targets[i].nbytes:
                return -1  # a value of another size: not these pages'
            scatter_from(payload, targets[i])
            out[i] = True
            return len(payload)

        try:
            self._read_many(keys, take)
        finally:
            set_marks(marks, flags)  # set at the end (no row is done before)
        return out

    def _read_many(self, keys: Sequence[str], take: _Take) -> None:
        """Read ``keys`` through a staging buffer; ``take(index, checked payload view)``
        keeps a value (the view dies with the call) and answers its size, -1 to refuse."""
        self._check_open()
        kbs = [key_bytes(k) for k in keys]
        taken: list[int] = []

        def counted(i: int, payload: memoryview) -> None:
            n = take(i, payload)
            if n >= 0:
                taken.append(n)

        try:
            self._get_into(keys, kbs, counted)
        except StoreError:
            self._count(errors=1)
            raise
        self._count(
            gets=len(keys), hits=len(taken), misses=len(keys) - len(taken), bytes_read=sum(taken)
        )

    def _get_into(
        self, keys: Sequence[str], kbs: list[bytes], take: Callable[[int, memoryview], None]
    ) -> None:
        exact: list[int] = []  # indexes whose value did not fit the guessed slot
        with self._staging() as buf:
            slot = min(self._slot, buf.size)
            per = max(1, buf.size // slot)
            for start in range(0, len(keys), per):
                idx = list(range(start, min(start + per, len(keys))))
                rcs = self._call(
                    buf,
                    SAFE_GET,
                    self._client.batch_get_into,
                    [keys[i] for i in idx],
                    [buf.addr + n * slot for n in range(len(idx))],
                    [slot] * len(idx),
                )
                for n, (i, rc) in enumerate(zip(idx, rcs, strict=True)):
                    if rc >= 0:
                        payload = self._unframe(keys[i], kbs[i], buf.view[n * slot : n * slot + rc])
                        if payload is not None:
                            take(i, payload)
                    elif rc == INVALID_PARAMS:
                        exact.append(i)
                    elif rc not in MISS:
                        raise StoreError(f"mooncake store: get of {keys[i]!r}: {code_name(rc)}")
            for i in exact:
                self._get_exact(buf, i, keys[i], kbs[i], take)

    def _get_exact(
        self,
        buf: RegisteredBuffer,
        i: int,
        key: str,
        kb: bytes,
        take: Callable[[int, memoryview], None],
    ) -> None:
        """Read one value whose size exceeded the slot guess, using its exact size."""
        try:
            size = self._client.get_size(key)
        except RuntimeError as exc:
            raise StoreError(f"mooncake store: get_size of {key!r} raised: {exc}") from exc
        if size in MISS:
            return
        if size < 0:
            raise StoreError(f"mooncake store: get_size of {key!r}: {code_name(size)}")
        self._slot = max(self._slot, size)
        if size > buf.size:
            with self.registered_buffer(size) as big:
                payload = self._read_one(big, key, kb, size)
                if payload is not None:
                    take(i, payload)
            return
        payload = self._read_one(buf, key, kb, size)
        if payload is not None:
            take(i, payload)

    def _read_one(self, buf: RegisteredBuffer, key: str, kb: bytes, size: int) -> memoryview | None:
        (rc,) = self._call(buf, SAFE_GET, self._client.batch_get_into, [key], [buf.addr], [size])
        if rc in MISS:
            return None
        if rc < 0:
            raise StoreError(f"mooncake store: get of {key!r} ({size} bytes): {code_name(rc)}")
        return self._unframe(key, kb, buf.view[:rc])

    def _unframe(self, key: str, kb: bytes, framed: memoryview) -> memoryview | None:
        """The checked payload (a view into ``framed``), or None after removing a corrupt
        value."""
        try:
            verify(kb, framed[:HEADER_SIZE], framed[HEADER_SIZE:], self._secret)
        except CorruptValue as exc:
            rc = self._client.remove(key, True)
            log.warning("mooncake store: dropped corrupt value %r (%s); remove rc=%s", key, exc, rc)
            self._count(corrupt=1)
            return None
        return framed[HEADER_SIZE:]
