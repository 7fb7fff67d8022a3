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
from collections.abc import Sequence
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    as_bytes_view,
    copy_framed,
    key_bytes,
    load_store_key,
    make_header,
)
from ucm_patch.hooks.stores.keys import key_default
from ucm_patch.hooks.stores.mooncake_buffers import MooncakeBuffers, RegisteredBuffer
from ucm_patch.hooks.stores.mooncake_codes import (
    CODE_NAMES,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OK,
    SAFE_PUT,
    code_name,
)
from ucm_patch.hooks.stores.mooncake_gets import MooncakeGets

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 30.0


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


class MooncakeStore(MooncakeGets, MooncakeBuffers):
    """Mooncake Store client with checksummed values and registered staging buffers.

    Its parts, by job: the registered memory (:class:`~.mooncake_buffers.MooncakeBuffers`)
    and the gets through it (:class:`~.mooncake_gets.MooncakeGets`); here: the client's
    setup, the puts, presence and close."""

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
        # _buffers guards _free, _quarantine and _busy. Lock order: _buffers, then the stats
        # lock (KVStore's leaf lock: a quarantine is counted under _buffers), never the other
        # way. The closed flag is KVStore's: close() sets it before it takes _buffers to
        # wait for the busy buffers, and _acquire reads it under _buffers, so no buffer is
        # handed out once close() has seen none busy.
        self._buffers = threading.Condition()
        self._free: list[RegisteredBuffer] = []
        self._quarantine: list[RegisteredBuffer] = []  # kept alive until release_at
        self._busy = 0  # pooled buffers in use
        self._pooled = staging_buffers
        self._slot = 256 << 10  # read slot size guess; grows to the largest value seen
        # (address, size) of the caller's registered regions: a tuple replaced whole under
        # _regions_lock (which guards nothing else), so that a put reads it without one
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

    # -- puts -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store framed values via ``batch_put_from``; False for keys skipped as full."""
        self._check_open()
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
                rcs = self._call(buf, SAFE_PUT, put, keys, ptrs, sizes)
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

    def _put_chunk(
        self, buf: RegisteredBuffer, chunk: list[tuple[str, bytes, memoryview]]
    ) -> list[int]:
        ptrs, sizes, off = [], [], 0
        for _key, kb, payload in chunk:
            end = off + HEADER_SIZE + len(payload)
            body = buf.view[off + HEADER_SIZE : end]
            buf.view[off : off + HEADER_SIZE] = copy_framed(kb, body, payload, self._secret)
            ptrs.append(buf.addr + off)
            sizes.append(end - off)
            off = end
        keys = [c[0] for c in chunk]
        return self._call(buf, SAFE_PUT, self._client.batch_put_from, keys, ptrs, sizes)

    # -- presence / lifecycle -------------------------------------------------------------

    def _label(self) -> str:
        return f"mooncake store (master {self.master!r})"

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence via ``batch_is_exist`` (1 present, 0 absent, negative -> StoreError)."""
        self._check_open()
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
        if not self._mark_closed():
            return
        with self._buffers:
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
