"""Mooncake Store client (distributed, in-memory) behind :class:`KVStore`.

Why Mooncake: it is the KV-cache engine that real deployments share between vLLM instances;
its zero-copy batch calls are its fastest path over TCP (docs/BENCHMARKS.md, section 5,
measures them next to this store's own put and get).

Design (measurements: docs/BENCHMARKS.md):

* ``mooncake`` is imported only when this store is built, so nothing else needs the wheel.
* Setup uses P2PHANDSHAKE metadata and TCP by default. ``MC_STORE_CLIENT_SETUP_RETRIES``
  is set low (config ``mooncake_setup_retries``, default 1) so an absent master fails
  setup in ≈4 s with :class:`StoreError` instead of blocking ≈90 s.
* **Zero-copy puts from registered memory.** The connector registers its (pinned) staging
  buffers (:meth:`MooncakeStore.register_host_memory`); a value that lies inside one is
  sent from there by ``batch_put_from_multi_buffers``, as two pieces: its frame header
  (computed over the payload where it lies, written into a staging buffer) and the
  payload itself; no copy on this side. Safe without a quarantine of the caller's
  memory: a put only reads it, and a transfer that read it late after a failure stores
  bytes its frame rejects (never served).
* Other data moves through a small pool of *registered staging buffers*: ``put_many``
  copies frame header + payload into one (a single memcpy) and calls ``batch_put_from``;
  ``get_many`` calls ``batch_get_into`` and copies each payload out into ``bytes``,
  ``get_many_into`` (what loads use) straight into the caller's buffers. Gets stay
  staged even into registered memory: a failed read can still complete into its buffer
  later (below), and only a buffer of this store can be quarantined for that. These
  calls return one status per key, unlike ``put_batch`` (one status per batch) and
  ``get_batch`` / ``batch_get_buffer``, which answer "missing" when the client's local
  buffer is merely exhausted. Values larger than a staging buffer get a one-off buffer.
* Status codes: 0 stored; -705 already exists -> True (content-hash keys are immutable,
  Mooncake keeps the first value); -200 NO_AVAILABLE_HANDLE (store full) -> False;
  -704 not found / -703 replica not ready -> miss; -600 on a get means "slot too small"
  and is retried with the exact size; any other negative code -> :class:`StoreError`.
* A failed transfer can still write into the registered buffer after the call returns
  (a timed-out TCP read completes later). After a code outside the known before-transfer
  rejections (e.g. -800 TRANSFER_FAIL when a storage node died) the buffer is quarantined:
  kept alive and unused for ``quarantine_s`` (default 60 s, beyond Mooncake's TCP progress
  and status timeouts that drop such connections), then reused. Memory stays bounded; while
  every buffer is quarantined, operations fail fast with :class:`StoreError`.
* Integrity: every value carries the frame of :mod:`ucm_patch.hooks.stores.framing`; a
  value that fails it is counted corrupt, removed with ``force=True`` and not served. With
  a store key set (environment) the frame is keyed; without one, a non-loopback
  ``local_hostname`` logs a warning at start (other hosts could write values we load).
* A dead master makes calls fail with -900 RPC_FAIL after ≈4 s (Mooncake's own RPC
  timeout), so no operation hangs; ``health_check()`` cannot detect it and is not used.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    copy_framed,
    key_bytes,
    load_store_key,
    make_header,
    verify,
)
from ucm_patch.hooks.stores.keys import key_default
from ucm_patch.hooks.stores.scatter import Scatter, check_targets, scatter_from, set_marks

log = logging.getLogger(__name__)

#: ``take(index, checked payload view) -> bytes kept, or -1 when refused`` (see _read_many).
_Take = Callable[[int, memoryview], int]

OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
RPC_FAIL = -900
RPC_TIMEOUT = -901

CODE_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

# Rejections that happen before any transfer is submitted (or after it completed): the
# buffer may be reused. Anything else may leave I/O in flight into the buffer.
_SAFE_COMMON = frozenset(
    {NO_AVAILABLE_HANDLE, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS}
    | {RPC_FAIL, RPC_TIMEOUT}
)
_SAFE_PUT = _SAFE_COMMON | {INVALID_PARAMS}
_SAFE_GET = _SAFE_COMMON | {INVALID_PARAMS, LEASE_EXPIRED}  # -600: buffer too small
_MISS = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, LEASE_EXPIRED})
_CLOSE_WAIT_S = 30.0


def code_name(rc: int) -> str:
    """``-900 (RPC_FAIL)`` style text for an error message."""
    return f"{rc} ({CODE_NAMES.get(rc, 'unknown')})"


class _Buffer:
    """A registered bytearray. ``unsafe``: a transfer into it may still be running."""

    def __init__(self, size: int, pooled: bool) -> None:
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.data))
        self.size = size
        self.pooled = pooled
        self.unsafe = False
        self.release_at = 0.0


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses: only then is a Mooncake segment out of
    reach of other hosts (so values need no key to be trusted)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class MooncakeStore(KVStore):
    """Mooncake Store client with checksummed values and registered staging buffers."""

    name = "mooncake"

    def __init__(
        self,
        *,
        master: str,
        protocol: str = key_default("mooncake_protocol"),
        metadata_server: str = key_default("mooncake_metadata_server"),
        local_hostname: str = key_default("mooncake_local_hostname"),
        rdma_devices: str = key_default("mooncake_rdma_devices"),
        global_segment_bytes: int = key_default("mooncake_global_segment_bytes"),
        local_buffer_bytes: int = key_default("mooncake_local_buffer_bytes"),
        staging_bytes: int = key_default("mooncake_staging_bytes"),
        staging_buffers: int = key_default("mooncake_staging_buffers"),
        quarantine_s: float = key_default("mooncake_quarantine_s"),
        setup_retries: int | None = key_default("mooncake_setup_retries"),
    ) -> None:
        super().__init__()
        self.stats["quarantined"] = 0
        self.stats["zero_copy_puts"] = 0  # values sent from the caller's registered memory
        try:
            self._secret = load_store_key()
        except ValueError as exc:
            raise StoreError(f"mooncake store: {exc}") from exc
        if self._secret is None and not is_loopback(local_hostname):
            log.warning(
                "mooncake store: mooncake_local_hostname=%r is reachable from other hosts and "
                "no store key is set: any client of the master can write values this "
                "process will load; set UCM_PATCH_STORE_KEY or UCM_PATCH_STORE_KEY_FILE",
                local_hostname,
            )
        self.master = master
        self.quarantine_s = quarantine_s
        self._warn = RateLimitedLog(log, 30.0)  # skipped puts: one line per cause per 30 s
        self._stats_lock = threading.Lock()
        self._buffers = threading.Condition()  # guards _free, _quarantine, _busy, _closed
        self._free: list[_Buffer] = []
        self._quarantine: list[_Buffer] = []  # kept alive until release_at
        self._busy = 0  # pooled buffers in use
        self._pooled = staging_buffers
        self._closed = False
        self._slot = 256 << 10  # read slot size guess; grows to the largest value seen
        # (address, size) of the caller's registered regions: a tuple replaced whole under
        # the lock, so that a put reads it without one
        self._regions: tuple[tuple[int, int], ...] = ()
        self._regions_lock = threading.Lock()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(
                "mooncake store: cannot import mooncake.store (pip install "
                "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1 libnuma1 "
                f"libcurl4): {exc}"
            ) from exc
        if setup_retries is not None:
            os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(setup_retries)
        else:
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        self._client: Any = MooncakeDistributedStore()
        started = time.monotonic()
        try:
            rc = self._client.setup(
                local_hostname,
                metadata_server,
                global_segment_bytes,
                local_buffer_bytes,
                protocol,
                rdma_devices,
                master,
            )
        except RuntimeError as exc:
            raise StoreError(f"mooncake store: setup raised for master {master!r}: {exc}") from exc
        if rc != 0:
            raise StoreError(
                f"mooncake store: setup failed with rc={rc} after "
                f"{time.monotonic() - started:.1f}s (master={master!r}, protocol={protocol!r}, "
                f"metadata_server={metadata_server!r}); is mooncake_master running and "
                "reachable? Mooncake's log lines on stderr say more"
            )
        try:
            self._free = [self._new_buffer(staging_bytes, True) for _ in range(staging_buffers)]
        except StoreError:
            self._client.close()
            raise

    # -- buffers --------------------------------------------------------------------------

    def register_host_memory(self, addr: int, size: int) -> bool:
        """Register the caller's buffer with the Mooncake client: puts from it are zero-copy
        (module docstring). False when the store is closed, or (logged) when the client
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

    def _new_buffer(self, size: int, pooled: bool) -> _Buffer:
        buf = _Buffer(size, pooled)
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

    def _quarantine_locked(self, buf: _Buffer) -> None:
        buf.release_at = time.monotonic() + self.quarantine_s
        self._quarantine.append(buf)
        with self._stats_lock:
            self.stats["quarantined"] += 1

    def _acquire(self) -> _Buffer:
        """A free staging buffer; waits while others are busy, fails fast if all are held back."""
        with self._buffers:
            while True:
                if self._closed:
                    raise StoreError(f"mooncake store (master {self.master!r}) is closed")
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

    def _release(self, buf: _Buffer) -> None:
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
    def _staging(self) -> Iterator[_Buffer]:
        buf = self._acquire()
        try:
            yield buf
        finally:
            self._release(buf)

    @contextmanager
    def registered_buffer(self, size: int) -> Iterator[_Buffer]:
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

    def _call(self, buf: _Buffer, safe: frozenset[int], fn: Any, *args: Any) -> list[int]:
        """Run a batch call on ``buf``; mark the buffer unsafe on unconfirmed results."""
        try:
            rcs = list(fn(*args))
        except RuntimeError as exc:
            buf.unsafe = True
            raise StoreError(f"mooncake store: {fn.__name__} raised: {exc}") from exc
        if len(rcs) != len(args[0]) or any(rc < 0 and rc not in safe for rc in rcs):
            buf.unsafe = True
        return rcs

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError(f"mooncake store (master {self.master!r}) is closed")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self.stats[name] += delta

    # -- puts -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store framed values via ``batch_put_from``; False for keys skipped as full."""
        self._check_usable()
        slot_of: list[int] = []  # input index -> unique index (first value per key wins)
        first: dict[str, int] = {}
        unique: list[tuple[str, bytes, memoryview]] = []
        for key, value in items:
            kb = key_bytes(key)
            if key not in first:
                first[key] = len(unique)
                unique.append((key, kb, as_bytes_view(value)))
            slot_of.append(first[key])
        codes = [OK] * len(unique)
        try:
            self._put_unique(unique, codes)
        except StoreError:
            self._count(errors=1)
            raise
        failed = [(unique[i][0], rc) for i, rc in enumerate(codes) if rc < 0 and not _put_ok(rc)]
        stored = [rc == OK or rc == OBJECT_ALREADY_EXISTS for rc in codes]
        full = codes.count(NO_AVAILABLE_HANDLE)
        if full:
            self._say_full(full, unique, codes)
        self._count(
            puts=len(items),
            skipped_full=full,
            bytes_written=sum(len(u[2]) for u, rc in zip(unique, codes, strict=True) if rc == OK),
            errors=1 if failed else 0,
        )
        if failed:
            key, rc = failed[0]
            raise StoreError(
                f"mooncake store: put of {len(failed)} of {len(unique)} keys failed, first "
                f"{key!r}: {code_name(rc)}"
            )
        return [stored[i] for i in slot_of]

    def _say_full(
        self, full: int, unique: list[tuple[str, bytes, memoryview]], codes: list[int]
    ) -> None:
        """Values the cluster had no room for (NO_AVAILABLE_HANDLE): one WARNING per 30 s.
        Mooncake sets no per-value limit of its own here (a value larger than a staging
        buffer gets a buffer of its own); its room is what the clients contribute."""
        largest = max(
            [len(u[2]) for u, rc in zip(unique, codes, strict=True) if rc == NO_AVAILABLE_HANDLE]
        )
        self._warn.warning(
            "no room",
            "mooncake store (master %s): %d value(s) of up to %d bytes not stored: no room "
            "in the cluster (NO_AVAILABLE_HANDLE; mooncake_global_segment_bytes is what this "
            "client contributes)",
            self.master, full, largest,
        )  # fmt: skip

    def _put_unique(self, unique: list[tuple[str, bytes, memoryview]], codes: list[int]) -> None:
        direct: list[tuple[int, int]] = []  # (index, payload address) in registered memory
        staged: list[int] = []
        regions = self._regions
        for i, (_key, _kb, payload) in enumerate(unique):
            self._slot = max(self._slot, HEADER_SIZE + len(payload))
            addr = _address(payload) if regions else None
            end = addr + len(payload) if addr is not None else 0
            if addr is not None and any(a <= addr and end <= a + n for a, n in regions):
                direct.append((i, addr))
            else:
                staged.append(i)
        if direct:
            self._put_direct(unique, direct, codes)
        if staged:
            self._put_staged(unique, staged, codes)

    def _put_direct(
        self, unique: list[tuple[str, bytes, memoryview]], direct: list[tuple[int, int]],
        codes: list[int],
    ) -> None:  # fmt: skip
        """Zero-copy: each value as (its frame header in a staging buffer, its payload
        where it lies) through ``batch_put_from_multi_buffers``."""
        with self._staging() as buf:
            per = buf.size // HEADER_SIZE
            for start in range(0, len(direct), per):
                part = direct[start : start + per]
                keys: list[str] = []
                ptrs: list[list[int]] = []
                sizes: list[list[int]] = []
                for n, (i, addr) in enumerate(part):
                    key, kb, payload = unique[i]
                    at = n * HEADER_SIZE
                    buf.view[at : at + HEADER_SIZE] = make_header(kb, payload, self._secret)
                    keys.append(key)
                    ptrs.append([buf.addr + at, addr])
                    sizes.append([HEADER_SIZE, len(payload)])
                put = self._client.batch_put_from_multi_buffers
                rcs = self._call(buf, _SAFE_PUT, put, keys, ptrs, sizes)
                for (i, _addr), rc in zip(part, rcs, strict=True):
                    codes[i] = rc
        self._count(zero_copy_puts=len(direct))

    def _put_staged(
        self, unique: list[tuple[str, bytes, memoryview]], idx: list[int], codes: list[int]
    ) -> None:
        """Frame header + payload copied into a registered staging buffer, many per call."""
        with self._staging() as buf:
            p = 0
            while p < len(idx):
                size = HEADER_SIZE + len(unique[idx[p]][2])
                if size > buf.size:
                    with self.registered_buffer(size) as big:
                        codes[idx[p]] = self._put_chunk(big, [unique[idx[p]]])[0]
                    p += 1
                    continue
                q, used = p, 0
                while q < len(idx) and used + HEADER_SIZE + len(unique[idx[q]][2]) <= buf.size:
                    used += HEADER_SIZE + len(unique[idx[q]][2])
                    q += 1
                rcs = self._put_chunk(buf, [unique[j] for j in idx[p:q]])
                for j, rc in zip(idx[p:q], rcs, strict=True):
                    codes[j] = rc
                p = q

    def _put_chunk(self, buf: _Buffer, chunk: list[tuple[str, bytes, memoryview]]) -> list[int]:
        ptrs, sizes, off = [], [], 0
        for _key, kb, payload in chunk:
            end = off + HEADER_SIZE + len(payload)
            body = buf.view[off + HEADER_SIZE : end]
            buf.view[off : off + HEADER_SIZE] = copy_framed(kb, body, payload, self._secret)
            ptrs.append(buf.addr + off)
            sizes.append(end - off)
            off = end
        keys = [c[0] for c in chunk]
        return self._call(buf, _SAFE_PUT, self._client.batch_put_from, keys, ptrs, sizes)

    # -- gets -----------------------------------------------------------------------------

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
        self._check_usable()
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
                    _SAFE_GET,
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
                    elif rc not in _MISS:
                        raise StoreError(f"mooncake store: get of {keys[i]!r}: {code_name(rc)}")
            for i in exact:
                self._get_exact(buf, i, keys[i], kbs[i], take)

    def _get_exact(
        self, buf: _Buffer, i: int, key: str, kb: bytes, take: Callable[[int, memoryview], None]
    ) -> None:
        """Read one value whose size exceeded the slot guess, using its exact size."""
        try:
            size = self._client.get_size(key)
        except RuntimeError as exc:
            raise StoreError(f"mooncake store: get_size of {key!r} raised: {exc}") from exc
        if size in _MISS:
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

    def _read_one(self, buf: _Buffer, key: str, kb: bytes, size: int) -> memoryview | None:
        (rc,) = self._call(buf, _SAFE_GET, self._client.batch_get_into, [key], [buf.addr], [size])
        if rc in _MISS:
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

    # -- presence / lifecycle -------------------------------------------------------------

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence via ``batch_is_exist`` (1 present, 0 absent, negative -> StoreError)."""
        self._check_usable()
        for key in keys:
            key_bytes(key)
        if not keys:
            return []
        try:
            rcs = list(self._client.batch_is_exist(list(keys)))
        except RuntimeError as exc:
            self._count(errors=1)
            raise StoreError(f"mooncake store: batch_is_exist raised: {exc}") from exc
        bad = [(k, rc) for k, rc in zip(keys, rcs, strict=False) if rc not in (0, 1)]
        if bad or len(rcs) != len(keys):
            self._count(errors=1)
            what = f"{bad[0][0]!r}: rc={bad[0][1]}" if bad else f"{len(rcs)} answers"
            raise StoreError(f"mooncake store: batch_is_exist failed for {what}")
        return [rc == 1 for rc in rcs]

    def close(self) -> None:
        """Wait (bounded) for operations in flight, then close the client. Idempotent.

        Calls are bounded by Mooncake's own timeouts (≈4 s for a dead master); if one still
        runs after ``_CLOSE_WAIT_S`` the client is left open, because closing it under a
        running native call could crash the process.
        """
        deadline = time.monotonic() + _CLOSE_WAIT_S
        with self._buffers:
            if self._closed:
                return
            self._closed = True
            self._buffers.notify_all()
            while self._busy and time.monotonic() < deadline:
                self._buffers.wait(timeout=deadline - time.monotonic())
            if self._busy:
                log.warning("mooncake store: close timed out; client left open (call in flight)")
                return
        self._client.close()


def _address(view: memoryview) -> int | None:
    """Where ``view``'s bytes start, or None when it cannot lie in registered memory (a
    read-only or empty view: ``bytes`` are never registered)."""
    if view.readonly or not view.c_contiguous or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _put_ok(rc: int) -> bool:
    return rc in (OK, OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE)


__all__ = ["CODE_NAMES", "MooncakeStore", "code_name"]
