"""The Mooncake store's registered memory (:class:`MooncakeBuffers`, a part of
:class:`~.mooncake.MooncakeStore`): the pool of staging buffers registered with the
client, one-off buffers for larger values, the quarantine of a buffer a failed transfer
may still write into, and the caller's own regions offered for zero-copy puts.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ucm_patch.hooks.stores.base import KVStore, StoreError

#: The store's logger (:mod:`.mooncake`'s): its lines keep the name users filter on.
log = logging.getLogger("ucm_patch.hooks.stores.mooncake")


class RegisteredBuffer:
    """A registered bytearray. ``unsafe``: a transfer into it may still be running."""

    def __init__(self, size: int, pooled: bool) -> None:
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.data))
        self.size = size
        self.pooled = pooled
        self.unsafe = False
        self.release_at = 0.0


class MooncakeBuffers(KVStore):
    """The registered memory of a :class:`~.mooncake.MooncakeStore`: its state (below) is
    set up by the store's ``__init__``, which documents the locks."""

    quarantine_s: float
    _client: Any
    _buffers: threading.Condition
    _free: list[RegisteredBuffer]
    _quarantine: list[RegisteredBuffer]
    _busy: int
    _pooled: int
    _regions: tuple[tuple[int, int], ...]
    _regions_lock: threading.Lock

    def register_host_memory(self, addr: int, size: int) -> bool:
        """Register the caller's buffer with the Mooncake client: puts from it are zero-copy
        (:mod:`.mooncake`'s docstring). False when the store is closed, or (logged) when the client
        refuses it: the caller's buffer then just goes through the staged path."""
        if self._closed:
            return False
        rc = self._client.register_buffer(addr, size)
        if rc != 0:
            log.warning("mooncake store: register_buffer(%d bytes) failed: rc=%s", size, rc)
            return False
        with self._regions_lock:
            self._regions = (*self._regions, (addr, size))
        return True

    def unregister_host_memory(self, addr: int) -> None:
        with self._regions_lock:
            kept = tuple(r for r in self._regions if r[0] != addr)
            if len(kept) == len(self._regions):
                return
            self._regions = kept
        if not self._closed and self._client.unregister_buffer(addr) != 0:
            log.warning("mooncake store: unregister_buffer(0x%x) failed", addr)

    def _new_buffer(self, size: int, pooled: bool) -> RegisteredBuffer:
        buf = RegisteredBuffer(size, pooled)
        rc = self._client.register_buffer(buf.addr, size)
        if rc != 0:
            raise StoreError(f"mooncake store: register_buffer({size} bytes) failed: rc={rc}")
        return buf

    def _recycle_locked(self) -> None:
        """Give quarantined buffers whose time is up back to the pool (or unregister them)."""
        now = time.monotonic()
        for buf in [b for b in self._quarantine if b.release_at <= now]:
            self._quarantine.remove(buf)
            buf.unsafe = False
            if buf.pooled:
                self._free.append(buf)
            elif self._client.unregister_buffer(buf.addr) != 0:
                self._quarantine_locked(buf)  # still registered: keep it alive a while longer

    def _quarantine_locked(self, buf: RegisteredBuffer) -> None:
        buf.release_at = time.monotonic() + self.quarantine_s
        self._quarantine.append(buf)
        self._count(quarantined=1)

    def _acquire(self) -> RegisteredBuffer:
        """A free staging buffer; waits while others are busy, fails fast if all are held back."""
        with self._buffers:
            while True:
                self._check_open()
                self._recycle_locked()
                if self._free:
                    self._busy += 1
                    return self._free.pop()
                if self._busy == 0:
                    wait = min(b.release_at for b in self._quarantine) - time.monotonic()
                    raise StoreError(
                        f"mooncake store: all {self._pooled} staging buffers are quarantined "
                        "after transfers that failed unconfirmed (storage node down?); the "
                        f"next is released in {max(0.0, wait):.0f}s"
                    )
                self._buffers.wait(timeout=1.0)

    def _release(self, buf: RegisteredBuffer) -> None:
        """Return a buffer; one that may still be written to is quarantined, not reused."""
        unregister = not buf.pooled and not buf.unsafe
        if unregister and self._client.unregister_buffer(buf.addr) != 0:
            buf.unsafe = True  # cannot prove it is idle
        with self._buffers:
            if buf.pooled:
                self._busy -= 1
            if buf.unsafe:
                self._quarantine_locked(buf)
            elif buf.pooled:
                self._free.append(buf)
            self._buffers.notify_all()

    @contextmanager
    def _staging(self) -> Iterator[RegisteredBuffer]:
        buf = self._acquire()
        try:
            yield buf
        finally:
            self._release(buf)

    @contextmanager
    def registered_buffer(self, size: int) -> Iterator[RegisteredBuffer]:
        """A one-off buffer of ``size`` bytes registered with the client (``.view``,
        ``.addr``), released or quarantined on exit: a value larger than a staging buffer,
        and benchmarks that call :attr:`client`'s batch calls on it."""
        buf = self._new_buffer(size, False)
        try:
            yield buf
        finally:
            self._release(buf)

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` under this store, for benchmarks of Mooncake's
        own batch calls (the transport's ceiling, without framing or staging)."""
        return self._client

    def _call(self, buf: RegisteredBuffer, safe: frozenset[int], fn: Any, *args: Any) -> list[int]:
        """Run a batch call on ``buf``; mark the buffer unsafe on unconfirmed results."""
        try:
            rcs = list(fn(*args))
        except RuntimeError as exc:
            buf.unsafe = True
            raise StoreError(f"mooncake store: {fn.__name__} raised: {exc}") from exc
        if len(rcs) != len(args[0]) or any(rc < 0 and rc not in safe for rc in rcs):
            buf.unsafe = True
        return rcs
