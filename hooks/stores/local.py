"""The embedded default store: two tiers of large reused segments on one host.

Why segments and not a file per value: a put then costs one copy into pages the kernel
already holds, not a file creation per value (the old design's put ran at a few percent
of memcpy, a ceiling of the design). docs/CONNECTOR.md#store measures the alternatives
(LMDB for the values themselves, a file per value) against this one.

* **memory tier** (``memory_bytes`` > 0): segments on a tmpfs (default ``/dev/shm``, see
  :func:`default_memory_path`), mapped into every process that uses the store: the engine
  core, the TP workers, other vLLM instances on the host. A put and a get are one copy.
* **disk tier** (``path``): segments written with ``pwritev`` and read with ``preadv``.
  The memory tier spills to it: the values of a memory segment being emptied are written
  to the disk tier first. A full store's puts that find the memory tier's reserve dry go
  around it, into disk segments the cleaner emptied ahead (one copy instead of a put and
  a spill), and one recency order over both tiers decides what is evicted
  (:func:`~.segment_cleaner.refill_two`). Without a memory tier, puts go straight to disk.

Each tier is a :class:`~ucm_patch.hooks.stores.tier.Tier`: a shared LMDB index (key digest
-> segment, generation, offset), segments leased to one writer at a time, one capacity per
directory for every process, least-recently-used segments emptied first.

Guarantees (each proven in tests/test_store_local*.py):

* Coherent across processes: the index is the only truth; a put answers True once its
  index transaction committed (or another writer's value was there: the first wins).
* A torn, half-written or forged value is never served: keys are published only after
  their bytes are written, every read checks the integrity frame (key-bound checksum, or
  the keyed MAC with ``UCM_PATCH_STORE_KEY``), and a location whose segment was emptied
  meanwhile reads as a miss. A failing value is counted in ``stats["corrupt"]``, dropped
  from the index and not served.
* A process killed mid-write (SIGKILL) leaves a store that opens and serves every value
  it had published: LMDB transactions are atomic, its segment lease is taken over once
  its pid is gone, and only the unpublished tail of that segment is lost.
* Owner only: directories 0700, files 0600 (``dir_mode`` / ``file_mode``); segment files
  are opened with ``O_NOFOLLOW`` through the tier's directory descriptor and a symlink in
  place of the index's files is removed, never followed. No one else's directory or
  file (:mod:`.ownership`): one made beforehand by another user, or writable by others
  beyond those modes, is refused at start with a :class:`StoreError` naming its path,
  owner and mode; files are created with ``O_EXCL`` and checked with ``fstat``.
* No RAM left behind (:mod:`.memory_tiers`): the last process to close the store spills
  the memory tier to disk and removes it (or keeps ``memory_keep_bytes`` of it); a tier
  whose ``local_path`` is gone is removed by the next store that opens on the host.
* A full file system (ENOSPC) empties least recently used segments and retries once;
  then :class:`StoreError`. The default disk capacity (none configured) is 10 GiB capped
  at start by the free space plus the bytes already stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores import memory_tiers, rowcopy
from ucm_patch.hooks.stores.base import StoreError, ValueSizeError
from ucm_patch.hooks.stores.dirty_pages import DirtyGauge
from ucm_patch.hooks.stores.framing import HEADER_SIZE, key_bytes, load_store_key
from ucm_patch.hooks.stores.keys import key_default
from ucm_patch.hooks.stores.local_reads import LocalReads, digest_of
from ucm_patch.hooks.stores.local_writes import LocalWrites
from ucm_patch.hooks.stores.segment_index import Loc
from ucm_patch.hooks.stores.tier import (
    MIN_SEGMENTS,
    RECORD_HEADER,
    Held,
    Spill,
    Tier,
    TierTooSmall,
    segment_for,
)

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 10 << 30
DEFAULT_SEGMENT = key_default("local_segment_bytes")
DEFAULT_MEMORY = 2 << 30
#: Longest the last process of a memory tier spends at close writing the values the tier
#: would lose to the disk tier, bounded so a stopping server stops; later ones are dropped.
EXIT_SPILL_S = 30.0


def default_memory_path(disk_path: str | os.PathLike[str]) -> str:
    """Where the memory tier of the store in ``disk_path`` lives: one directory per disk
    directory, under ``$XDG_RUNTIME_DIR/ucm_patch`` (a per-user tmpfs) when set, else
    under ``/dev/shm/ucm_patch-<uid>``."""
    name = hashlib.blake2b(os.fsencode(os.path.abspath(disk_path)), digest_size=8).hexdigest()
    return os.path.join(memory_tiers.tier_base(), name)


def default_memory_bytes(memory_path: str | None, disk_path: str, value_bytes: int = 0) -> int:
    """An eighth of the tmpfs the memory tier would live on, at most 2 GiB; 0 (no memory
    tier) when that file system cannot be found, or when that is under
    :data:`~ucm_patch.hooks.stores.tier.MIN_SEGMENTS` segments holding a value of
    ``value_bytes`` (said with a warning: nobody asked for that size)."""
    where = memory_path or default_memory_path(disk_path)
    while where and not os.path.isdir(where):
        where = os.path.dirname(where)
    try:
        vfs = os.statvfs(where or "/dev/shm")
    except OSError:
        return 0
    size = min(DEFAULT_MEMORY, vfs.f_blocks * vfs.f_frsize // 8)
    if size and size < MIN_SEGMENTS * segment_for(value_bytes):
        log.warning(
            "local store %s: no memory tier: its default size (%d bytes, an eighth of the "
            "tmpfs %s) is under %d segments holding a value of %d bytes; set "
            "local_memory_bytes to at least %d to have one",
            disk_path, size, where, MIN_SEGMENTS, value_bytes,
            MIN_SEGMENTS * segment_for(value_bytes),
        )  # fmt: skip
        return 0
    return size


@contextlib.contextmanager
def scratch_memory_tiers() -> Iterator[str]:
    """For demos and benchmarks whose store directories are temporary: the default memory
    tiers of stores opened meanwhile, in this process and in children started meanwhile
    (``XDG_RUNTIME_DIR``, see :func:`default_memory_path`), live in one directory on
    ``/dev/shm`` that is removed on exit. A tier allocates its capacity when it opens, so
    a tier left behind per run would take that memory for good."""
    base = tempfile.mkdtemp(
        prefix="ucm_patch-scratch-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = base
    try:
        yield base
    finally:
        if before is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = before
        shutil.rmtree(base, ignore_errors=True)


def _weak_spill(store: LocalStore) -> Spill:
    """``store._spill`` without a reference to ``store``: the memory tier holding it would
    make a cycle, and a store dropped without ``close()`` would then live (and its tier's
    warmer keep allocating) until the cycle collector ran."""
    method = weakref.WeakMethod(store._spill)

    def spill(view: memoryview, live: list[Held], stamp: int) -> bool:
        target = method()
        return target is not None and target(view, live, stamp)

    return spill


class Placement(NamedTuple):
    tier: str
    file: str
    offset: int
    size: int


class LocalStore(LocalWrites, LocalReads):
    """Values in segments: an optional shared-memory tier that spills to a disk tier.

    Its parts, by job: the two-tier put path (:class:`~.local_writes.LocalWrites`) and
    the reads (:class:`~.local_reads.LocalReads`); here: opening both tiers, the refusals
    at start, tools' introspection, and the close that settles the memory tier. The
    stats, their lock and the closed flag are :class:`~.base.KVStore`'s: the store has no
    lock of its own (the tiers lock what they share)."""

    name = "local"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        fsync: bool = key_default("local_fsync"),
        dir_mode: int = key_default("local_dir_mode"),
        file_mode: int = key_default("local_file_mode"),
        memory_bytes: int = 0,
        memory_path: str | os.PathLike[str] | None = None,
        segment_bytes: int = DEFAULT_SEGMENT,
        value_bytes: int = 0,
        memory_keep_bytes: int = key_default("local_memory_keep_bytes"),
    ) -> None:
        """``value_bytes``: the largest value the caller will put (the connector's, from
        its layout; 0: not known). Both tiers get segments that hold one, larger than
        ``segment_bytes`` when need be; a tier whose capacity is under
        :data:`~ucm_patch.hooks.stores.tier.MIN_SEGMENTS` of them, or whose directory was
        created with smaller segments, is refused here (:class:`ValueSizeError` naming
        the keys), except a memory tier of an older layout, which is left out with a
        warning (values then go to disk)."""
        super().__init__()
        for counter in (
            "disk_full", "spilled", "memory_hits", "disk_hits", "reserve_dry", "written_around"
        ):  # fmt: skip
            self.stats[counter] = 0
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0 (0: no memory tier), got {memory_bytes!r}")
        self.path = os.path.abspath(os.fspath(path))
        self._warn = RateLimitedLog(log, 30.0)
        try:
            self._secret = load_store_key()
        except ValueError as exc:
            raise StoreError(f"local store: {exc}") from exc
        need = segment_for(value_bytes)
        if value_bytes and 0 < memory_bytes < MIN_SEGMENTS * need:  # before anything is made
            too_small = TierTooSmall("memory", "", memory_bytes, value_bytes, need, None)
            raise self._too_small(too_small, capacity_bytes, memory_bytes, segment_bytes)
        capacity = capacity_bytes or self._default_capacity()
        try:
            self.disk = Tier(
                "disk", self.path, capacity, segment_bytes, mapped=False, fsync=fsync,
                dir_mode=dir_mode, file_mode=file_mode, secret=self._secret,
                value_bytes=value_bytes,
            )  # fmt: skip
        except TierTooSmall as exc:
            raise self._too_small(exc, capacity_bytes, memory_bytes, segment_bytes) from None
        self.memory: Tier | None = None
        # what the memory tier keeps once no process uses it (close, memory_tiers)
        self.memory_keep_bytes = max(0, memory_keep_bytes)
        self._memory_use: memory_tiers.TierUse | None = None
        memory_tiers.sweep()  # the host's memory tiers whose local_path is gone
        if memory_bytes:
            where = os.fspath(memory_path) if memory_path else default_memory_path(self.path)
            in_base = memory_path is None
            self._memory_use = self._use_memory_tier(where, in_base, dir_mode, file_mode)
            try:
                self.memory = Tier(
                    "memory", where, memory_bytes, segment_bytes, mapped=True,
                    dir_mode=dir_mode, file_mode=file_mode, spill=_weak_spill(self),
                    secret=self._secret, value_bytes=value_bytes,
                )  # fmt: skip
            except TierTooSmall as exc:  # an older layout (its capacity was checked above)
                log.warning(
                    "local store %s: its memory tier %s has segments of %d bytes (fixed when "
                    "it was created), too small for values of %d bytes: running without it "
                    "(values go to disk); remove that directory while no process uses it to "
                    "have it made again",
                    self.path, where, exc.layout, value_bytes,
                )  # fmt: skip
            except BaseException:  # refused (ownership) or failed: nothing stays open
                self._memory_use.finish()
                self.disk.close()
                raise
        if self.memory is None and self._memory_use is not None:
            self._memory_use.finish()
            self._memory_use = None
        if self.memory is not None:  # its reserve is refilled by a process of its own
            self.memory.cleaner.use_process(self.disk)
            # the row helper built or loaded now, not in the first hit's read
            rowcopy.available()
        self.tiers: tuple[Tier, ...] = (self.memory, self.disk) if self.memory else (self.disk,)
        # a second core hashes the disk tier's puts where no cleaner process needs it
        self.disk.hash_beside = self.memory is None
        self.capacity_bytes = self.disk.capacity_bytes
        self.fsync = fsync
        self._dirty = DirtyGauge()
        #: this process writes around the memory tier until its disk segment is full
        self._around = False
        self._sync_counters()

    def _use_memory_tier(
        self, where: str, in_base: bool, dir_mode: int, file_mode: int
    ) -> memory_tiers.TierUse:
        """Start using the memory tier at ``where`` (:func:`memory_tiers.attach`: this
        process counts among its users until :meth:`close`); the disk tier is closed when
        that is refused."""
        try:
            return memory_tiers.attach(
                where, self.path, self.disk.dir_fd, dir_mode, file_mode, in_base=in_base
            )
        except BaseException:
            self.disk.close()
            raise

    def _too_small(
        self, exc: TierTooSmall, capacity_bytes: int | None, memory_bytes: int, segment_bytes: int
    ) -> ValueSizeError:
        """The start-time refusal of a tier that cannot hold the values, with the keys."""
        v, need = exc.value_bytes, exc.need
        if exc.layout is not None:  # only the disk tier's directory refuses like this
            return ValueSizeError(
                f"local store {self.path}: values of {v} bytes do not fit its segments of "
                f"{exc.layout} bytes (local_segment_bytes, or a quarter of "
                "local_capacity_bytes when smaller, fixed when the directory was created): "
                "set local_path to a new directory, or remove this one"
            )
        key = "local_memory_bytes" if exc.tier == "memory" else "local_capacity_bytes"
        have = f"{key} {exc.capacity}"
        if exc.tier == "disk" and not capacity_bytes:
            have += " (the default, capped by the free space)"
        fix = f"set {key} to at least {MIN_SEGMENTS * need}"
        if exc.tier == "memory":
            fix += ", or to 0 (no memory tier)"
        return ValueSizeError(
            f"local store {self.path}: {have} cannot hold values of {v} bytes, the largest "
            f"to be stored: it needs {MIN_SEGMENTS} segments of at least {need} bytes (a "
            f"segment is local_segment_bytes {segment_bytes}, or a quarter of the capacity "
            "when smaller, and holds at least one value; local_memory_bytes "
            f"{memory_bytes}, 0: no memory tier): {fix}"
        )

    def max_value_bytes(self) -> int | None:
        """The largest value a put can store: a segment less its record header."""
        return self.disk.segment_bytes - RECORD_HEADER

    def _default_capacity(self) -> int:
        """10 GiB, capped by the free space plus what the directory already holds. The free
        space is that of the nearest existing directory: the store's own directory and its
        parents may not exist yet (the tier creates them), and a fresh path must not read as
        unbounded on a nearly full disk."""
        where = self.path
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        try:
            vfs = os.statvfs(where)
        except OSError:
            return DEFAULT_CAPACITY
        held = 0
        if os.path.isdir(self.path):
            for entry in os.scandir(self.path):
                if entry.name.startswith("seg-") and entry.is_file(follow_symlinks=False):
                    held += entry.stat(follow_symlinks=False).st_blocks * 512
        room = vfs.f_bavail * vfs.f_frsize + held
        if room < DEFAULT_CAPACITY:
            log.info("local store %s: default capacity capped at %d bytes (free space plus "
                     "%d bytes already stored)", self.path, room, held)  # fmt: skip
            return max(room, 4096)
        return DEFAULT_CAPACITY

    def _label(self) -> str:
        return f"local store {self.path!r}"

    # -- introspection / lifecycle ----------------------------------------------------------

    def placements(self) -> list[Placement]:
        """Where every value lies, both tiers (a scan: for tools and tests)."""
        return [
            self._placement(tier, loc) for tier in self.tiers for _d, loc in tier.index.entries()
        ]

    @staticmethod
    def _placement(tier: Tier, loc: Loc) -> Placement:
        return Placement(
            tier.name, tier.files.where(loc.seg), loc.offset + RECORD_HEADER, loc.size - HEADER_SIZE
        )

    def where(self, key: str) -> Placement | None:
        """Where ``key``'s payload lies (tier, segment file, offset, bytes), None when
        missing: for tools and tests that inspect or damage a value in place."""
        digest = digest_of(key_bytes(key))
        for tier in self.tiers:
            loc = tier.lookup([digest])[0]
            if loc is not None:
                return self._placement(tier, loc)
        return None

    def forget(self, keys: Sequence[str]) -> int:
        """Drop ``keys`` from both tiers, as an eviction would (tools and tests; the bytes
        stay until their segment is reused): how many were present."""
        self._check_open()
        digests = [digest_of(key_bytes(k)) for k in keys]
        return sum(tier.index.remove(digests) for tier in self.tiers)

    def clear(self) -> None:
        """Drop every value of both tiers (tools and tests)."""
        self._check_open()
        for tier in self.tiers:
            tier.index.remove_all()

    @property
    def used_bytes(self) -> int:
        """Bytes of current segments in both tiers (record headers and padding included)."""
        return sum(t.stats()[1] for t in self.tiers)

    def __len__(self) -> int:
        """Values in both tiers (a scan: for tests and tools, not hot paths)."""
        return sum(t.stats()[0] for t in self.tiers)

    def prepare_writes(self) -> None:
        """Start the memory tier's cleaner process now (it starts on the first put
        otherwise): it refills the reserve and runs the index work of the dump threads
        (:mod:`.publish_channel`), which do that work themselves until it serves, about a
        second after it starts. A worker that dumps calls this at start, so that its
        first dumps find it serving."""
        self._check_open()
        if self.memory is not None:
            self.memory.cleaner.ensure_started()

    def expect_puts(self, values: int, nbytes: int, puts: int) -> None:
        """The memory tier asks its cleaner process for the leases those puts need beyond
        the ones kept, without waiting (:meth:`Tier.expect_puts`); a closed store, or a
        channel that cannot take the request now, asks nothing."""
        memory = self.memory
        if memory is not None and not self._closed:
            memory.expect_puts(values, nbytes, puts)

    def wait_writes_ready(self, timeout: float = 30.0) -> bool:
        """Wait until what :meth:`prepare_writes` started serves (the cleaner process
        answers on its publish channels): False on timeout. For benchmarks and tools
        whose first put follows the store's opening at once; the connector never waits
        for it (its first dumps publish themselves meanwhile)."""
        self._check_open()
        return self.memory is None or self.memory.cleaner.wait_serving(timeout)

    def close(self, spill_s: float | None = None) -> None:
        """Refuse further operations and release handles. Values stay: in the disk tier,
        and in the memory tier while another process uses it.

        The last process using the memory tier (:mod:`.memory_tiers`) shrinks it to
        ``memory_keep_bytes`` of its most recently used segments: the values of the
        others are written to the disk tier first (for at most ``spill_s`` seconds,
        :data:`EXIT_SPILL_S` by default: the connector closes its stores at exit right
        after the dump scheduler's exit flush), their files removed; with 0 (the default)
        the tier itself is removed, so no RAM stays behind in the tmpfs."""
        if not self._mark_closed():
            return
        use, memory = self._memory_use, self.memory
        last = use is not None and memory is not None and use.is_last()
        if last:
            assert memory is not None
            self._settle(memory, EXIT_SPILL_S if spill_s is None else spill_s)
        for tier in self.tiers:
            tier.close()
        if use is not None:
            use.finish(remove=last and self.memory_keep_bytes == 0)
            self._memory_use = None

    def _settle(self, memory: Tier, spill_s: float) -> None:
        """The last user's close: the memory tier trimmed to ``memory_keep_bytes``, its
        other values spilled to disk within ``spill_s`` (:meth:`Tier.trim`)."""
        before = memory.spilled
        try:
            lost = memory.trim(self.memory_keep_bytes, time.monotonic() + spill_s)
        except (OSError, StoreError) as exc:
            log.warning("local store %s: memory tier %s not spilled at close: %s",
                        self.path, memory.path, exc)  # fmt: skip
            return
        finally:
            self._sync_counters()
        if lost:
            log.warning(
                "local store %s: %d values of the memory tier %s dropped at close: not "
                "spilled to disk within %.0f s", self.path, lost, memory.path, spill_s,
            )  # fmt: skip
        log.info(
            "local store %s: last user of the memory tier %s: %d values spilled to disk, "
            "%s", self.path, memory.path, memory.spilled - before,
            f"{self.memory_keep_bytes} bytes kept" if self.memory_keep_bytes else "removed",
        )  # fmt: skip


__all__ = [
    "DEFAULT_CAPACITY",
    "LocalStore",
    "Placement",
    "default_memory_bytes",
    "default_memory_path",
    "digest_of",
    "scratch_memory_tiers",
]
