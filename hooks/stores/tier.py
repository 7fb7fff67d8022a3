"""One tier of the local store: a directory of reused segments and their shared index.

A put appends whole batches to a segment this process has leased (no lock while the bytes
are copied: the lease is exclusive), then publishes the batch's keys in one index
transaction. A get looks keys up, copies the bytes, and asks the index whether the segment
was emptied meanwhile (then the copy is a miss, whatever it holds).

Record layout in a segment (64-byte aligned, so payloads are too)::

    digest 16 B | 28 B unused | frame header 20 B | payload | pad to 64 B

The frame header (:mod:`~ucm_patch.hooks.stores.framing`) checksums the key and payload,
so the index never needs to be trusted for content: a stale or forged location reads as
corrupt, never as a value.

Capacity is a number of segments of one size, per directory (the index records both). When
no segment is free, the least recently used one that no live process is writing is
emptied: its values are handed to ``spill`` first (the memory tier spills to the disk
tier), then its generation goes up, which makes every entry into it stale at once.
Eviction is by segment, so "recently used" is kept per segment: a put or a hit stamps the
segment's slot in the shared ``lru`` file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    PIECE,
    CorruptValue,
    copy_framed,
    copy_framed_many,
    copy_verified,
    copy_verified_many,
    make_header,
    scatter_verified_many,
    verify,
)
from ucm_patch.hooks.stores.memcopy import copy_bytes
from ucm_patch.hooks.stores.ownership import ForeignFile, check_entries, open_dir, open_file
from ucm_patch.hooks.stores.scatter import Scatter
from ucm_patch.hooks.stores.segment_cleaner import LEASE_IDLE_S, SegmentCleaner, reserve_for
from ucm_patch.hooks.stores.segment_files import (
    FileSegments,
    MappedSegments,
    SegmentLost,
    segment_name,
)
from ucm_patch.hooks.stores.segment_index import LOC, Loc, SegmentIndex, SegRow, pid_alive
from ucm_patch.hooks.stores.sidecar import sidecar

log = logging.getLogger(__name__)

RECORD_HEADER = 64  # digest, zero fill, frame header: the payload starts 64-byte aligned
FRAME_AT = RECORD_HEADER - HEADER_SIZE  # where the frame (header + payload) starts
_PAD = bytes(FRAME_AT - 16)
_ZEROS = bytes(64)
_BLANK_HEADER = bytes(HEADER_SIZE)  # a frame header not written yet: reads as corrupt
#: A mapped segment's values copy on the sidecar from this size on. Below it the fused
#: copy (each piece hashed right after its copy, still in the cache) was as fast or faster
#: in bench_stores (1 MiB values); at 2 MiB the copy beside the checksum was faster.
MAPPED_SIDECAR_MIN = 8 * PIECE

#: How long a put that found the memory tier's reserve dry lets the next puts answer
#: "skipped" without a look at the index, unless a cleaner spilled meanwhile
#: (:meth:`Tier._dry_again`): a segment readied without a spill (one with no live values,
#: or a lease given back with room) is seen after at most this long.
DRY_RECHECK_S = 0.002

MAX_SEGMENTS = 1 << 16
MIN_SEGMENTS = 4  # a smaller capacity gets smaller segments: eviction stays gradual
_TICK = struct.Struct("<Q")
#: After the stamps in ``lru``: the tier's counts of values spilled, and dropped by a
#: failed spill, by whichever process spilled them (the cleaner process, mostly).
_SHARED_COUNTS = 2
#: A value: its key digest, its key's bytes (or, spilled, its frame header) and payload.
Record = tuple[bytes, bytes, memoryview]
#: Where a live value lies in its segment: (key digest, record offset, frame bytes).
Held = tuple[bytes, int, int]
#: Takes a segment being emptied: its records from offset 0 to the end of the last live
#: one, the live ones among them (:meth:`Tier.adopt` writes them in one copy), and the
#: segment's last use (its place in the recency order, which the copy keeps).
Spill = Callable[[memoryview, list[Held], int], None]


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a memory file system (tmpfs, ramfs), by the longest mount
    point of ``/proc/self/mounts`` above it; False when that cannot be read. Only there
    does allocating a segment ahead take memory a put would otherwise fault in (a memory
    tier pointed at a disk would reserve disk space with it, for nothing)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if line.count(" ") >= 3]
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")


def _warm(ref: weakref.ref[Tier], count: int) -> None:
    """Allocate and map every segment of a tier's capacity, in the background, once per
    process (a memory tier on a tmpfs; the tier's warmer thread runs this).

    Why: the first write into a page of a tmpfs file allocates the page and faults it
    into the mapping. On a virtual machine with 4 KiB pages that costs several times
    the copy into a mapped page, and a put into fresh segments fell behind the KV a GPU
    produces (docs/GPU.md, docs/CONNECTOR.md#store: the measurements). A reader that
    maps a segment in its process pays the mapping part too. So the capacity is
    allocated (and mapped) when the store opens, like the pinned pool of LMCache or
    the CPU buffer of vLLM's offloading connector: what a put or a get
    finds is mapped, and a segment emptied for reuse keeps its pages. At the lowest
    CPU priority (a thread's nice value, Linux), so it never competes with serving;
    ENOSPC or any other error stops it quietly: the put path meets and handles it.
    It never allocates the last quarter of the file system ahead of use: /dev/shm is
    shared (vLLM's and NCCL's shared-memory buffers live there too); a put still takes
    that room when it needs it, as before.

    The thread holds the tier weakly: a store dropped without ``close()`` (a test's, a
    tool's) is not kept alive by it, and warming stops at its next segment.
    """
    with contextlib.suppress(OSError):  # per-thread nice: Linux's setpriority on a tid
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for seg in range(count):
        tier = ref()
        if tier is None or not tier._warm_segment(seg):
            return
        del tier


def record_bytes(payload: int) -> int:
    return (RECORD_HEADER + payload + 63) & ~63


def segment_for(value_bytes: int) -> int:
    """The smallest segment (whole 4 KiB pages) that holds one value of ``value_bytes``."""
    return max(4096, (record_bytes(value_bytes) + 4095) & ~4095)


class TierTooSmall(StoreError):
    """A tier cannot hold the values it was opened for (``value_bytes``): its capacity is
    under :data:`MIN_SEGMENTS` segments that hold one, or (``layout`` set) its directory
    was created with segments of ``layout`` bytes, smaller than ``need``. The local store
    words it with the config keys to change (:class:`~ucm_patch.hooks.stores.local.LocalStore`)."""

    def __init__(
        self, tier: str, path: str, capacity: int, value_bytes: int, need: int, layout: int | None
    ) -> None:
        self.tier, self.path, self.capacity = tier, path, capacity
        self.value_bytes, self.need, self.layout = value_bytes, need, layout
        if layout is None:
            why = f"capacity {capacity} is under {MIN_SEGMENTS} segments of {need} bytes"
        else:
            why = f"its segments are {layout} bytes, fixed when the directory was created"
        super().__init__(f"{tier} tier {path}: cannot hold values of {value_bytes} bytes: {why}")


@dataclass
class Lease:
    """A segment this process appends to: nobody else writes it while we hold it."""

    seg: int
    gen: int
    end: int
    used: float = 0.0  # time.monotonic() of its last put (kept leases: given back when idle)


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


def _call(fn: Callable[[], None]) -> None:
    fn()


def _copy_each(copies: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in copies:
        copy_bytes(dst, src)


class Tier:
    """A directory of segments with one capacity shared by every process on the host."""

    def __init__(
        self,
        name: str,
        path: str,
        capacity_bytes: int,
        segment_bytes: int,
        mapped: bool,
        fsync: bool = False,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
        spill: Spill | None = None,
        secret: bytes | None = None,
        value_bytes: int = 0,
        warm: bool = True,
    ) -> None:
        """``warm``: a mapped tier on a tmpfs allocates its capacity in the background
        (:func:`_warm`; the cleaner process, which only empties segments, does not)."""
        self.name = name
        self.mapped, self.file_mode, self.dir_mode = mapped, file_mode, dir_mode
        self.secret = secret  # the store key of keyed frames (framing.load_store_key)
        self.path = os.path.abspath(path)
        self.fsync = fsync
        self.spill = spill
        #: runs a spill's write into this tier (:meth:`adopt`): here, by default; the
        #: cleaner process runs it on a thread of low CPU priority (:mod:`.cleaner_process`)
        self.run_spill_write: Callable[[Callable[[], None]], None] = _call
        self._dropped = 0  # values this process dropped (not spilled) for capacity
        self.disk_full = 0  # ENOSPC answered by evicting and retrying
        self.reserve_dry = 0  # puts that found no ready segment (a spilling tier: skipped)
        self._warn = RateLimitedLog(log, 30.0)
        self._lock = threading.Lock()  # guards the counters above
        self._last: Lease | None = None  # where the last lease given back left off
        # (spill count, until when) after a lease found the reserve dry (:meth:`_new_lease`)
        self._dry: tuple[int, float] | None = None
        # leases kept between puts (one per thread putting at once), given back when idle
        # by the cleaner; a forked child starts with none (they are its parent's)
        self._kept: list[Lease] = []
        self._kept_pid = os.getpid()
        self._kept_lock = threading.Lock()
        # Segments hold the largest value the caller will put (``value_bytes``, 0: not
        # known): refused before anything is created when fewer than MIN_SEGMENTS fit.
        need = segment_for(value_bytes)
        if value_bytes and capacity_bytes < MIN_SEGMENTS * need:
            raise TierTooSmall(name, self.path, capacity_bytes, value_bytes, need, None)
        # made here, or this user's and writable by nobody else (ownership): refused at
        # start like the segments and lru already there that are not the store's to use
        self._dir = open_dir(self.path, dir_mode, f"{name} tier", follow=True)[0]
        try:
            ours = [n for n in os.listdir(self._dir) if n.startswith("seg-") or n == "lru"]
            check_entries(self._dir, self.path, ours, file_mode, f"{name} tier")
        except BaseException:
            os.close(self._dir)
            raise
        # index room: about 100 bytes per value of 64 KiB, twice over for LMDB's
        # copy-on-write pages and stale entries
        index_bytes = (capacity_bytes // 64 + (1 << 20) - 1) & ~((1 << 20) - 1)
        self.index = SegmentIndex(self.path, dir_mode, file_mode, fsync, index_bytes)
        wanted = max(need, min(segment_bytes, capacity_bytes // MIN_SEGMENTS) & ~4095)
        count = max(1, min(MAX_SEGMENTS, capacity_bytes // wanted))
        self.segment_bytes, self.count, previous = self.index.layout(wanted, count)
        if self.segment_bytes < need:  # a directory made for smaller values: refused
            self.index.close()
            os.close(self._dir)
            raise TierTooSmall(
                name, self.path, capacity_bytes, value_bytes, need, self.segment_bytes
            )
        if previous is None and wanted > segment_bytes:
            log.info("%s tier %s: segments of %d bytes (not %d), to hold values of %d bytes",
                     name, self.path, wanted, segment_bytes, value_bytes)  # fmt: skip
        if previous is not None and previous[1] != count:
            log.warning(
                "%s tier %s: capacity was %d segments of %d bytes, now %d (this process's "
                "capacity applies to every process from now on)",
                name,
                self.path,
                previous[1],
                self.segment_bytes,
                count,
            )
        if self.segment_bytes != wanted:
            self.count = max(1, min(MAX_SEGMENTS, capacity_bytes // self.segment_bytes))
        self.capacity_bytes = self.count * self.segment_bytes
        cls = MappedSegments if mapped else FileSegments
        self.files = cls(self._dir, self.path, self.segment_bytes, file_mode)
        stamps = self._open_ticks(file_mode)
        self._ticks = stamps[:MAX_SEGMENTS]
        self._shared = stamps[MAX_SEGMENTS:]
        self._shared_base = tuple(self._shared)
        stamps.release()
        # a spilling tier keeps segments ready so that no put empties one (.segment_cleaner)
        self.reserve = reserve_for(self.count) if spill is not None else 0
        self.cleaner = SegmentCleaner(self)
        self._warmer: threading.Thread | None = None
        self._stop_warming = threading.Event()
        if not self.index.read_only:
            self._shrink()
            if warm and mapped and on_tmpfs(self.path):
                self._warmer = threading.Thread(
                    target=_warm,
                    args=(weakref.ref(self), self.count),
                    name=f"ucm-{name}-tier-warmer",
                    daemon=True,
                )
                self._warmer.start()

    def _warm_segment(self, seg: int) -> bool:
        """Allocate and map segment ``seg`` (:func:`_warm`); False when warming stops."""
        if self._stop_warming.is_set():
            return False
        try:
            if not self._allocated(seg):
                fs = os.statvfs(self.path)
                if (fs.f_bavail - fs.f_blocks // 4) * fs.f_frsize < self.segment_bytes:
                    log.debug("%s tier %s: warming stopped at segment %d (a quarter of "
                              "the file system left)", self.name, self.path, seg)  # fmt: skip
                    return False
            self.files.fd(seg, create=True)
        except (OSError, StoreError) as exc:
            log.debug(
                "%s tier %s: warming stopped at segment %d: %s", self.name, self.path, seg, exc
            )
            return False
        return True

    def _allocated(self, seg: int) -> bool:
        """Whether segment ``seg``'s file exists with all its pages (mapping it takes none)."""
        try:
            st = os.stat(segment_name(seg), dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            return False
        return st.st_blocks * 512 >= self.segment_bytes

    # -- start-up ---------------------------------------------------------------------------

    def _open_ticks(self, file_mode: int) -> memoryview:
        """The shared last-use stamps, one u64 per segment (``lru``): written without a
        lock (an 8-byte aligned store), read when a victim is picked."""
        size = (MAX_SEGMENTS + _SHARED_COUNTS) * _TICK.size
        where = os.path.join(self.path, "lru")
        try:  # created exclusively, checked once open (ownership)
            fd = open_file("lru", self._dir, where, file_mode, create=True)[0]
        except ForeignFile as exc:
            raise StoreError(f"{self.name} tier: refused {where}: {exc.strerror}") from exc
        except OSError as exc:
            if not self.index.read_only:
                raise StoreError(f"{self.name} tier: cannot open {self.path}/lru: {exc}") from exc
            self._ticks_map = mmap.mmap(-1, size)  # read-only directory: nothing to evict
            return memoryview(self._ticks_map).cast("Q")
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != file_mode:
                os.fchmod(fd, file_mode)  # the umask may have cut what config asked for
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._ticks_map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return memoryview(self._ticks_map).cast("Q")

    def _shrink(self) -> None:
        """Segments beyond this capacity (a smaller one than last time) are emptied and
        their files removed, unless a live process still writes them."""
        for seg, row in sorted(self.index.segments().items()):
            if seg >= self.count and row.end and self._takeable(row):
                self._empty(seg, row, remove=True)

    # -- writes -----------------------------------------------------------------------------

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

    def release_idle_leases(self, idle_s: float = LEASE_IDLE_S) -> None:
        """Give back the kept leases unused for ``idle_s`` (the cleaner, and close with 0)."""
        cutoff = time.monotonic() - idle_s
        with self._kept_lock:
            if self._kept_pid != os.getpid():
                return
            idle = [lease for lease in self._kept if lease.used <= cutoff]
            self._kept = [lease for lease in self._kept if lease.used > cutoff]
        for lease in idle:
            self._seal_quietly(lease)

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
        for i in pending:
            record = records[i]
            n = len(record[2])
            size = (RECORD_HEADER + n + 63) & ~63
            if end + size > room:
                break
            batch.append(record)
            locs.append((record[0], pack(seg, gen, end, HEADER_SIZE + n)))
            end += size
        try:
            try:
                self._write(lease, batch, end, framed)
            except OSError as exc:
                self.files.cut(seg, lease.end)  # a partly written batch: space back
                where = self.files.where(seg)
                raise StoreError(f"{self.name} tier: cannot write {where!r}: {exc}") from exc
            if not self.index.publish(seg, gen, os.getpid(), locs, lease.end, end):
                raise StoreError(f"{self.name} tier: lost segment {seg} mid-write")
            self.index.flush()
        except BaseException:
            self._seal_quietly(lease)
            raise
        lease.end = end
        self.touch(seg)
        return lease, len(batch)

    def _write(self, lease: Lease, batch: list[Record], end: int, framed: bool) -> None:
        """Write ``batch`` from ``lease.end`` on. A mapped segment takes the whole batch in
        one native call where the row helper is built (:meth:`_write_framed_in_one_call`).
        Otherwise a batch of large values (``PIECE`` for a file,
        :data:`MAPPED_SIDECAR_MIN` for a mapping) is copied on this thread's sidecar
        while their frames are computed here (:meth:`_write_hashing_meanwhile`), and
        otherwise a mapped segment gets each payload copied once and its frame computed on
        the copy (hot in the cache: the checksum costs no second trip to memory; a payload
        over ``PIECE`` piece by piece, so that it stays so), and a file segment gets one
        ``pwritev`` of the batch."""
        view = self.files.mapping(lease.seg, end, write=True)
        if view is not None and not framed and self._write_framed_in_one_call(lease, batch, view):
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

    def _seal(self, lease: Lease) -> None:
        self.index.release(lease.seg, lease.gen, os.getpid())
        self._last = Lease(lease.seg, lease.gen, lease.end)

    def _seal_quietly(self, lease: Lease) -> None:
        """Give ``lease`` back on a failure path (a full disk may refuse that too: then
        the segment is taken over once this process is gone)."""
        try:
            self._seal(lease)
        except StoreError as exc:
            self._warn.warning("seal", "%s tier: segment %d kept: %s", self.name, lease.seg, exc)

    def _takeable(self, row: SegRow) -> bool:
        return row.owner == 0 or (row.owner != os.getpid() and not pid_alive(row.owner))

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
        dry = self._dry
        if dry is not None:
            if self._shared[0] + self._shared[1] == dry[0] and time.monotonic() < dry[1]:
                return self._dry_again()
            self._dry = None
        last = self._last  # the segment this process appended to last, as it left it
        if last is not None and last.end + need <= self.segment_bytes:
            gen = self.index.claim(last.seg, SegRow(last.gen, last.end, 0), me, empty=False)
            if gen is not None:  # untouched since: no scan of the segment table
                return self._leased(last.seg, gen, last.end, stamp=stamp)
        for _attempt in range(16):
            rows = self.index.segments()
            free = [
                (self._ticks[seg], seg, row)
                for seg, row in rows.items()
                if seg < self.count and self._takeable(row)
            ]
            room = [f for f in free if f[2].end and f[2].end + need <= self.segment_bytes]
            if room:
                _tick, seg, row = max(room)
                gen = self.index.claim(seg, row, me, empty=False)
                if gen is not None:
                    return self._leased(seg, gen, row.end, stamp=stamp)
                continue
            fresh = next((s for s in range(self.count) if s not in rows), None)
            if fresh is not None:
                gen = self.index.claim(fresh, None, me, empty=True)
                if gen is not None:
                    return self._leased(fresh, gen, 0, ready=True, stamp=stamp)
                continue
            ready = [f for f in free if not f[2].end]  # emptied ahead (the reserve)
            if ready:
                _tick, seg, row = ready[0]
                gen = self.index.claim(seg, row, me, empty=False)
                if gen is not None:
                    return self._leased(seg, gen, 0, ready=True, stamp=stamp)
                continue
            if not free:
                break
            if self.spill is not None or not evict:
                break  # the reserve ran dry: skipped, never a spill on this thread
            _tick, seg, row = min(free)
            gen = self._empty(seg, row, remove=False)
            if gen is not None:
                return self._leased(seg, gen, 0, stamp=stamp)
        if self.spill is not None:
            self._dry = (self._shared[0] + self._shared[1], time.monotonic() + DRY_RECHECK_S)
            self.cleaner.wake()
            return self._dry_again()
        if not evict:
            with self._lock:
                self.reserve_dry += 1
        return None

    def _dry_again(self) -> None:
        """A put that found the reserve dry: counted, and no segment. Until a cleaner has
        spilled again (the tier's shared spill counts change) or :data:`DRY_RECHECK_S`
        passed, the next puts answer so without reading the index: with the reserve dry,
        a scan of the segment table per put only took CPU time from the spills that
        refill it (measured: bench_stores, "two tiers", 4 processes)."""
        with self._lock:
            self.reserve_dry += 1

    def adopt(self, src: memoryview, live: Sequence[Held], stamp: int | None = None) -> bool:
        """Take a whole segment of another tier being emptied (a spill): ``src`` is its
        records from offset 0 (the same record layout as here), ``live`` the values among
        them still current there. One write of ``src`` into a segment here, then one
        index transaction publishing ``live`` at the same offsets (shifted by where the
        write went; a key already current here keeps its value). Its other records are
        written too but never published (dead bytes until the segment is reused). False
        when ``src`` is larger than a segment here or every segment is a live process's
        lease: the caller then spills value by value. StoreError when the write fails
        (ENOSPC: least recently used segments are emptied and it is tried once more).
        ``stamp``: the spilled segment's last use, which the segment here takes
        (:meth:`_leased`); None: now."""
        n = len(src)
        if n > self.segment_bytes or n & 63:
            return False
        me = os.getpid()
        for attempt in range(2):
            lease = self._new_lease(n, stamp=stamp)
            if lease is None:
                return False
            seg, gen, start = lease.seg, lease.gen, lease.end
            try:
                try:
                    self.files.new_batch()
                    self.run_spill_write(partial(self._write_spill, seg, start, src))
                except OSError as exc:
                    self.files.cut(seg, start)
                    if exc.errno != errno.ENOSPC or attempt:
                        raise StoreError(
                            f"{self.name} tier: cannot write {self.files.where(seg)!r}: {exc}"
                        ) from exc
                    self._seal_quietly(lease)
                    lease = None
                    self._relieve(n, exc)
                    continue
                pack = LOC.pack
                locs = [(d, pack(seg, gen, start + off, size)) for d, off, size in sorted(live)]
                if not self.index.publish(seg, gen, me, locs, start, start + n):
                    raise StoreError(f"{self.name} tier: lost segment {seg} mid-write")
                lease.end = start + n
                if stamp is None:
                    self.touch(seg)
            finally:
                if lease is not None:
                    self._seal_quietly(lease)
            return True
        return False

    def _write_spill(self, seg: int, start: int, src: memoryview) -> None:
        """A spilled segment's bytes into ``seg`` at ``start``, then on their way to the
        device (fsync'd with ``fsync``, else written back from this thread:
        :meth:`~.segment_files.FileSegments.start_writeback`)."""
        self.files.write(seg, start, [src])
        if self.fsync:
            self.files.sync(seg)
        else:
            self.files.start_writeback(seg, start, len(src))

    def spec(self) -> dict[str, object]:
        """What opens this tier again in another process (the cleaner process)."""
        return {
            "name": self.name, "path": self.path, "capacity_bytes": self.capacity_bytes,
            "segment_bytes": self.segment_bytes, "mapped": self.mapped, "fsync": self.fsync,
            "dir_mode": self.dir_mode, "file_mode": self.file_mode,
        }  # fmt: skip

    def take_spill(self, view: memoryview, live: list[Held], stamp: int | None = None) -> None:
        """The :data:`Spill` of the tier above (the memory tier over the disk tier): a
        segment in one write (:meth:`adopt`), or value by value when this tier's segments
        are smaller (a directory created with an older size). The first value wins."""
        if self.adopt(view, live, stamp):
            return
        records: list[Record] = [
            (d, bytes(view[off + FRAME_AT : off + RECORD_HEADER]),
             view[off + RECORD_HEADER : off + FRAME_AT + size])
            for d, off, size in live
        ]  # fmt: skip
        present = self.lookup([d for d, _h, _p in records])
        self.put([r for r, loc in zip(records, present, strict=True) if loc is None], framed=True)

    def reserve_short(self) -> bool:
        """Whether the reserve lacks segments that could be emptied now (tools, tests)."""
        if not self.reserve:
            return False
        ready, victims = self.reserve_state()
        return ready < self.reserve and bool(victims)

    def reserve_state(self) -> tuple[int, list[tuple[int, int, SegRow]]]:
        """(segments ready: never used, or emptied and nobody's; the segments that could be
        emptied now, as (last use, segment, row), least recently used first): what a
        cleaner decides from."""
        rows = self.index.segments()
        ready = self.count - sum(1 for s in rows if s < self.count)
        victims = []
        for seg, row in rows.items():
            if seg < self.count and self._takeable(row):
                if row.end:
                    victims.append((self._ticks[seg], seg, row))
                else:
                    ready += 1
        return ready, sorted(victims)

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

    def empty_segment(self, victim: tuple[int, int, SegRow], drop: bool = False) -> bool:
        """Empty one segment of :meth:`reserve_state`'s victims, spilling its values (or
        dropping them with ``drop``) and giving it back ready: False when another process
        took it first (:func:`~.segment_cleaner.refill_two`)."""
        _tick, seg, row = victim
        return self._empty(seg, row, remove=False, release=True, drop=drop) is not None

    def holds_kept_lease(self) -> bool:
        """Whether this process keeps a lease here for its next put (one with room)."""
        with self._kept_lock:
            return self._kept_pid == os.getpid() and bool(self._kept)

    def empty_one_for_reserve(self) -> bool:
        """One step of the cleaner (:mod:`.segment_cleaner`): when fewer than
        :attr:`reserve` segments are ready (never used, or emptied and nobody's), spill and
        empty the least recently used one nobody writes, and give it back ready. True when
        it emptied one (call again), False when the reserve is full or nothing can be
        emptied now."""
        ready, victims = self.reserve_state()
        if ready >= self.reserve:
            return False
        return any(self.empty_segment(victim) for victim in victims)

    def _empty(
        self, seg: int, row: SegRow, remove: bool, release: bool = False, drop: bool = False
    ) -> int | None:
        """Take ``seg`` from its (dead or absent) owner, spill its live values (drop them
        with ``drop``: the recency order evicts them), start it over (and remove its file
        when ``remove``): the new generation, owned by this process (given back again
        when ``remove`` or ``release``), or None when another process took it."""
        me = os.getpid()
        counts = (0, 0)  # (spilled, dropped) by the spill
        if row.end and self.spill is not None and not drop:
            # held while its values are copied out, so that no writer appends meanwhile
            if self.index.claim(seg, row, me, empty=False) is None:
                return None
            row = SegRow(row.gen, row.end, me)
            alive = self.index.held(seg, row.gen)
            if alive:
                counts = self._spill(seg, alive)
        # given back (owner 0) in the same transaction that empties it when asked: a
        # cleaner refilling a reserve beside several writers spends one transaction per
        # segment, not two
        emptied = self.index.empty(seg, row, 0 if remove or release else me)
        if emptied is None:
            return None
        gen, dropped = emptied
        if drop:  # by a cleaner: counted where every process's stats see it
            counts = (0, dropped)
        elif self.spill is None and dropped:
            with self._lock:
                self._dropped += dropped
        if any(counts):  # after the release: writers read a change as "a segment is ready"
            self._count_shared(*counts)
        if remove:
            self.files.remove(seg)
        return gen

    def _spill(self, seg: int, live: list[Held]) -> tuple[int, int]:
        """Hand the segment's records up to its last live one, and the live ones, to
        ``spill``: (values spilled, values dropped because that failed), for the caller to
        count once the segment is empty. A mapped segment is handed as its mapping: the
        disk write reads it from there, no copy in between."""
        assert self.spill is not None
        try:
            end = (max(off + FRAME_AT + size for _d, off, size in live) + 63) & ~63
            view = self.files.mapping(seg, end)
            if view is None:
                view = memoryview(self.files.read(seg, 0, end))
            self.spill(view[:end], live, self._ticks[seg])
            return len(live), 0
        except (StoreError, CorruptValue, OSError) as exc:
            self._warn.warning(
                "spill", "%s tier: spilling segment %d failed: %s", self.name, seg, exc
            )
        return 0, len(live)

    def _relieve(self, need: int, exc: OSError) -> None:
        """ENOSPC: empty least recently used segments and remove their files until ``need``
        bytes and a tenth of the tier are freed (so the next puts do not hit the wall at
        once), then the caller retries once."""
        rows = self.index.segments()
        order = sorted(
            (self._ticks[s], s, r) for s, r in rows.items() if r.end and self._takeable(r)
        )
        goal = max(need, sum(r.end for r in rows.values()) // 10)
        freed = 0
        for _tick, seg, row in order:
            if freed >= goal:
                break
            if self._empty(seg, row, remove=True) is not None:
                freed += row.end
        with self._lock:
            self.disk_full += 1
        self._warn.warning(
            "enospc",
            "%s tier %s: file system full (%s); emptied %d bytes of segments, retrying once",
            self.name,
            self.path,
            exc.strerror,
            freed,
        )

    # -- reads ------------------------------------------------------------------------------

    def _count_shared(self, spilled: int, dropped: int) -> None:
        """Add to the tier's shared counts. Not atomic across processes: two cleaners that
        finish a spill in the same instant may count one of them short (a statistic, not
        a state anything acts on)."""
        counts = self._shared
        counts[0] += spilled
        counts[1] += dropped

    @property
    def spilled(self) -> int:
        """Values spilled from this tier since this process opened it, by any process."""
        return self._shared[0] - self._shared_base[0]

    @property
    def evictions(self) -> int:
        """Values dropped, not spilled, since this process opened the tier: by this process
        for capacity, or by any process's failed spill."""
        return self._dropped + self._shared[1] - self._shared_base[1]

    def stamps(self) -> bytes:
        """The recency stamps of every segment: changes whenever a put or a hit lands."""
        return self._ticks[: self.count].tobytes()

    def touch(self, seg: int) -> None:
        self._ticks[seg] = time.time_ns()

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

    # -- introspection / lifecycle -----------------------------------------------------------

    def stats(self) -> tuple[int, int]:
        """(values, bytes in current segments)."""
        return self.index.count()

    @property
    def dir_fd(self) -> int:
        """The tier directory's descriptor (open until :meth:`close`)."""
        return self._dir

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the warmer to map every segment (benchmarks that
        time a warm tier); True when no warmer is left running."""
        warmer = self._warmer
        if warmer is None:
            return True
        warmer.join(timeout)
        return not warmer.is_alive()

    def stop_warming(self) -> None:
        """Stop the warmer (at most one segment's allocation away) and wait for it."""
        warmer = self._warmer
        if warmer is not None:
            self._stop_warming.set()
            warmer.join()

    def quiesce(self) -> None:
        """Stop this process's background work on the tier (the warmer, the cleaner, each
        finishing what it is doing) and give back the leases it keeps."""
        self.stop_warming()
        self.cleaner.stop()
        self.release_idle_leases(idle_s=-1.0)

    def trim(self, keep_bytes: int, deadline: float) -> int:
        """Shrink the tier to at most ``keep_bytes`` of segment files, for the time no
        process uses it (the last one's close, :mod:`.memory_tiers`; the caller holds the
        tier alone). The most recently used segments holding values stay while they fit;
        the values of every other one go to ``spill``, most recently used first, until
        ``deadline`` (``time.monotonic``), and its file is removed, as is every segment
        file holding nothing. Values dropped without a spill (past the deadline): returned,
        and counted in ``evictions``."""
        self.quiesce()
        rows = self.index.segments()
        used = sorted(
            ((self._ticks[seg], seg) for seg, row in rows.items() if row.end),
            reverse=True,
        )
        keep: set[int] = set()
        for _tick, seg in used[: max(0, keep_bytes) // self.segment_bytes]:
            keep.add(seg)
        me = os.getpid()
        lost = 0
        for _tick, seg in used:
            if seg in keep:
                continue
            row = rows[seg]
            if time.monotonic() < deadline and self._empty(seg, row, remove=True) is not None:
                continue
            current = self.index.segments().get(seg)
            if current is None or not current.end:
                continue
            dropped = self.index.empty(seg, current, me)
            if dropped is not None:
                lost += dropped[1]
                self.index.release(seg, dropped[0], me)
        with self._lock:
            self._dropped += lost
        for name in os.listdir(self._dir):
            if name.startswith("seg-") and name[4:].isdigit() and int(name[4:]) not in keep:
                self.files.remove(int(name[4:]))
        return lost

    def close(self) -> None:
        self.quiesce()
        self.files.close()
        self.index.close()
        self._ticks.release()
        self._shared.release()
        try:
            self._ticks_map.close()
        except BufferError:
            pass
        os.close(self._dir)


__all__ = [
    "FRAME_AT",
    "RECORD_HEADER",
    "Lease",
    "Record",
    "Tier",
    "TierTooSmall",
    "record_bytes",
    "segment_for",
]
