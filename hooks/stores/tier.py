"""One tier of the local store: a directory of reused segments and their shared index.

A put appends whole batches to a segment this process has leased (no lock while the bytes
are copied: the lease is exclusive), then publishes the batch's keys in one index
transaction. A get looks keys up, copies the bytes, and asks the index whether the segment
was emptied meanwhile (then the copy is a miss, whatever it holds).

Each record is framed (:mod:`.tier_records`: the layout), so the index never needs to be
trusted for content: a stale or forged location reads as corrupt, never as a value.

Capacity is a number of segments of one size, per directory (the index records both). When
no segment is free, the least recently used one that no live process is writing is
emptied: its values are handed to ``spill`` first (the memory tier spills to the disk
tier), then its generation goes up, which makes every entry into it stale at once.
Eviction is by segment, so "recently used" is kept per segment: a put or a hit stamps the
segment's slot in the shared ``lru`` file.

The class is in parts, one job each: this module's :class:`Tier` holds the state (opened,
warmed, the recency stamps, closed); the put path is :mod:`.tier_writes`'s, the read path
:mod:`.tier_reads`'s, the leases of segments :mod:`.tier_leases`'s, and emptying segments
(spills, eviction, the reserve, adopting a spilled segment) :mod:`.tier_emptying`'s.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import PIECE
from ucm_patch.hooks.stores.ownership import ForeignFile, check_entries, open_dir, open_file
from ucm_patch.hooks.stores.segment_cleaner import SegmentCleaner, reserve_for
from ucm_patch.hooks.stores.segment_files import FileSegments, MappedSegments, segment_name
from ucm_patch.hooks.stores.segment_index import SegmentIndex
from ucm_patch.hooks.stores.tier_beside_writes import TierBesideWrites
from ucm_patch.hooks.stores.tier_emptying import TierEmptying
from ucm_patch.hooks.stores.tier_leases import Lease, TierLeases
from ucm_patch.hooks.stores.tier_reads import TierReads
from ucm_patch.hooks.stores.tier_records import (
    FRAME_AT,
    RECORD_HEADER,
    Held,
    Record,
    Spill,
    record_bytes,
    segment_for,
)

log = logging.getLogger(__name__)

MAX_SEGMENTS = 1 << 16
MIN_SEGMENTS = 4  # a smaller capacity gets smaller segments: eviction stays gradual
_TICK = struct.Struct("<Q")
#: After the stamps in ``lru``: the tier's counts of values spilled, and dropped by a
#: failed spill, by whichever process spilled them (the cleaner process, mostly).
_SHARED_COUNTS = 2


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


def _call(fn: Callable[[], None]) -> None:
    fn()


class Tier(TierBesideWrites, TierReads, TierLeases, TierEmptying):
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
        #: file puts hash on the process's checksum helper thread while they write
        #: (:func:`.rowcopy.frame_write_many`): set by a store whose only tier this is,
        #: where no cleaner process works beside its writers
        self.hash_beside = False
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
        # the channel and pid of a lease request sent ahead of a step's puts, its answer
        # not taken yet (TierBesideWrites.expect_puts)
        self._ahead = None
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

    # -- recency ----------------------------------------------------------------------------

    def stamps(self) -> bytes:
        """The recency stamps of every segment: changes whenever a put or a hit lands."""
        return self._ticks[: self.count].tobytes()

    def touch(self, seg: int) -> None:
        self._ticks[seg] = time.time_ns()

    # -- introspection / lifecycle -----------------------------------------------------------

    def stats(self) -> tuple[int, int]:
        """(values, bytes in current segments)."""
        return self.index.count()

    def spec(self) -> dict[str, object]:
        """What opens this tier again in another process (the cleaner process)."""
        return {
            "name": self.name, "path": self.path, "capacity_bytes": self.capacity_bytes,
            "segment_bytes": self.segment_bytes, "mapped": self.mapped, "fsync": self.fsync,
            "dir_mode": self.dir_mode, "file_mode": self.file_mode,
        }  # fmt: skip

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
    "PIECE",
    "RECORD_HEADER",
    "Held",
    "Lease",
    "Record",
    "Spill",
    "Tier",
    "TierTooSmall",
    "record_bytes",
    "segment_for",
]
