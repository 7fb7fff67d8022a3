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
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from xxhash import xxh3_128_digest

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores import memory_tiers, rowcopy
from ucm_patch.hooks.stores.base import KVStore, StoreError, ValueSizeError
from ucm_patch.hooks.stores.dirty_pages import DirtyGauge
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    key_bytes,
    load_store_key,
    verify,
)
from ucm_patch.hooks.stores.keys import key_default
from ucm_patch.hooks.stores.scatter import Scatter, check_targets, set_marks
from ucm_patch.hooks.stores.segment_files import SegmentLost
from ucm_patch.hooks.stores.segment_index import Loc
from ucm_patch.hooks.stores.tier import (
    MIN_SEGMENTS,
    RECORD_HEADER,
    Held,
    Record,
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


def digest_of(kb: bytes) -> bytes:
    """The 16-byte index key of a store key (keys may hold any characters and length).

    XXH3-128, not a cryptographic hash: two keys with one digest cannot make the store
    serve a wrong value, because the frame's check covers the whole key; the later key
    is only a miss."""
    return xxh3_128_digest(kb)


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

    def spill(view: memoryview, live: list[Held], stamp: int) -> None:
        target = method()
        if target is not None:
            target(view, live, stamp)

    return spill


class Placement(NamedTuple):
    tier: str
    file: str
    offset: int
    size: int


class LocalStore(KVStore):
    """Values in segments: an optional shared-memory tier that spills to a disk tier."""

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
        self._lock = threading.Lock()  # guards stats and _closed
        self._closed = False
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

    def _sync_counters(self) -> None:
        """The tiers count what they evict, spill and relieve; stats shows their sums."""
        with self._lock:
            for counter in ("evictions", "spilled", "disk_full", "reserve_dry"):
                self.stats[counter] = sum(getattr(t, counter) for t in self.tiers)

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

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"local store {self.path!r} is closed")

    def _bump(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.stats[k] += v

    # -- writes -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store values (first value per key wins); False when larger than a segment."""
        self._check_open()
        records: list[Record] = []
        for key, value in items:
            kb = key_bytes(key)
            view = value if type(value) is memoryview else memoryview(value)
            if view.format != "B" or view.ndim != 1:
                view = as_bytes_view(view)
            records.append((xxh3_128_digest(kb), kb, view))
        unique = len({r[0] for r in records}) == len(records)
        first: dict[bytes, int] = {}
        if not unique:  # a key twice in one put: its first value is the one stored
            for i, record in enumerate(records):
                first.setdefault(record[0], i)
            records = [records[i] for i in sorted(set(first.values()))]
        try:
            stored = self._put(records)
        except StoreError:
            self._bump(errors=1)
            raise
        finally:
            self._sync_counters()
        written = sum([len(r[2]) for r, ok in zip(records, stored, strict=True) if ok])
        if not all(stored):
            self._say_skipped(records, stored)
        if not unique:
            at = {r[0]: ok for r, ok in zip(records, stored, strict=True)}
            stored = [at[xxh3_128_digest(key_bytes(k))] for k, _v in items]
        self._bump(puts=len(items), skipped_full=stored.count(False), bytes_written=written)
        return stored

    def _say_skipped(self, records: list[Record], stored: list[bool]) -> None:
        """Why values were not stored, one WARNING per cause per 30 s (with the count of
        the lines held back): larger than a segment, or every segment being written by
        live processes. Only when a put skipped something: never on the normal path."""
        limit = self.disk.segment_bytes - RECORD_HEADER
        big = [
            len(r[2]) for r, ok in zip(records, stored, strict=True) if not ok and len(r[2]) > limit
        ]
        busy = stored.count(False) - len(big)
        if big:
            self._warn.warning(
                "value larger than a segment",
                "local store %s: %d value(s) of up to %d bytes not stored: larger than a "
                "segment holds (%d bytes: local_segment_bytes, or a quarter of "
                "local_capacity_bytes when smaller, fixed when the directory was created)",
                self.path, len(big), max(big), limit,
            )  # fmt: skip
        if busy and self.memory is not None:
            self._warn.warning(
                "memory tier dry",
                "local store %s: %d value(s) not stored: no segment of the memory tier %s "
                "was ready (its cleaner spills to the disk tier slower than values arrive, "
                "or live processes write all %d segments), and none went around it to the "
                "disk tier: it had no segment ready either, or the host's dirty pages are "
                "past the line where the kernel pauses writers (a put never waits for a "
                "spill, an eviction or a disk write)",
                self.path, busy, self.memory.path, self.memory.count,
            )  # fmt: skip
        elif busy:
            self._warn.warning(
                "every segment busy",
                "local store %s: %d value(s) not stored: all %d segments of the disk tier are "
                "being written by live processes (raise local_capacity_bytes for more)",
                self.path, busy, self.disk.count,
            )  # fmt: skip

    def _put(self, records: list[Record]) -> list[bool]:
        """Write into the first tier. A key already there is written again and then left
        as it was by the index (the first value wins): no lookup before every put, as a
        dump of a key already stored is rare (the scheduler dumps what a lookup missed).

        A value the memory tier had no ready segment for (its reserve ran dry: the store
        is full and values come faster than the spills) is **written around** it, into
        a ready segment of the disk tier's (:meth:`_write_around`): one copy into the
        page cache, where the memory tier costs it two (this put's, then the spill's).
        Past what that allows, the value is skipped (False, counted): the put never
        waits for a spill, an eviction or a disk write. A value larger than a memory
        segment always goes to the disk tier."""
        memory = self.memory
        try:
            if memory is None:
                return self.disk.put(records)
            tried_around = self._around and self._may_go_around()
            if tried_around:
                done = [False] * len(records)
                self._write_around(records, list(range(len(records))), done)
                todo = [i for i, ok in enumerate(done) if not ok]
                if todo:
                    for i, ok in zip(todo, memory.put([records[i] for i in todo]), strict=True):
                        done[i] = ok
            else:
                done = memory.put(records)  # the common case: the memory tier has room
            if all(done):
                return done
            limit = memory.segment_bytes - RECORD_HEADER
            big = [i for i, ok in enumerate(done) if not ok and len(records[i][2]) > limit]
            if big:
                for i, ok in zip(big, self.disk.put([records[i] for i in big]), strict=True):
                    done[i] = ok
            todo = [i for i, ok in enumerate(done) if not ok]
            if todo and not tried_around and self._may_go_around():
                self._write_around(records, todo, done)
        except (OSError, SegmentLost) as exc:
            raise StoreError(f"local store {self.path!r}: {exc}") from exc
        return done

    def _may_go_around(self) -> bool:
        """A put may go around the memory tier: its disk tier does not fsync (the put
        would wait for the disk), and the kernel lets pages be dirtied without pausing
        the writer (:class:`~.dirty_pages.DirtyGauge`)."""
        return not self.fsync and self._dirty.room()

    def _write_around(self, records: list[Record], todo: list[int], done: list[bool]) -> None:
        """Put ``records[todo]`` into the disk tier, marking ``done``: only into a segment
        with room or one the cleaner emptied ahead (never evicting here), when
        :meth:`_may_go_around`.

        Once a put went around, this process keeps writing around until its disk segment
        is full, and only then goes back to the memory tier: a segment then holds values
        put one after the other, so that the cleaner's one recency order over both tiers
        (:func:`~.segment_cleaner.refill_two`, by segment) is the order they were put in.
        Alternating per put, each segment would mix older and newer values."""
        had = self._around
        stored = self.disk.put([records[i] for i in todo], evict=False)
        for i, ok in zip(todo, stored, strict=True):
            done[i] = ok
        self._around = self.disk.holds_kept_lease()
        if not (had and self._around and all(stored)):
            # a ready disk segment was taken (or none was left): its process refills the
            # disk tier's reserve too; a put into the segment it kept takes none
            assert self.memory is not None
            self.memory.cleaner.wake()
        if any(stored):
            self._bump(written_around=sum(stored))

    def _spill(self, view: memoryview, live: list[Held], stamp: int) -> None:
        """A memory segment's values leaving it go to the disk tier (:meth:`Tier.take_spill`)."""
        self.disk.take_spill(view, live, stamp)

    # -- reads ------------------------------------------------------------------------------

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
        digests = [digest_of(kb) for kb in kbs]
        hits = corrupt = nbytes = memory_hits = 0
        try:
            for tier in self.tiers:
                if not todo:
                    break
                if located is not None and tier is self.memory:  # looked up by the caller
                    tier.files.new_batch()
                    locs = [located[i] for i in todo]
                else:
                    locs = tier.lookup([digests[i] for i in todo])
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
                        corrupt += self._corrupt(tier, digests[i], loc, keys[i])
                    found = []  # a value of another size is a miss, never corrupt
                elif targets is not None:  # into another memory: the same, page by page
                    fits = [(i, loc) for i, loc in found
                            if loc.size - HEADER_SIZE == targets[i].nbytes]  # fmt: skip
                    scattered = [(loc, kbs[i], targets[i]) for i, loc in fits]
                    # the marks go with the first tier's call (get_many_scattered)
                    ends = [(sum(1 for i, _l in fits if i < end), flag) for end, flag in marks]
                    results = tier.read_scattered_many(scattered, ends, flags)
                    for (i, loc), why in zip(fits, results, strict=True):
                        if why is None:
                            got.append((i, loc, b""))
                            continue
                        self._say_corrupt(tier, kbs[i], why)
                        corrupt += self._corrupt(tier, digests[i], loc, keys[i])
                    found = []
                for i, loc in found:
                    value = self._read_one(tier, loc, kbs[i])
                    if value is not None:
                        got.append((i, loc, value))
                    else:
                        corrupt += self._corrupt(tier, digests[i], loc, keys[i])
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
            self._bump(errors=1)
            raise StoreError(f"local store {self.path!r}: cannot read: {exc}") from exc
        self._bump(
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

    def close(self, spill_s: float | None = None) -> None:
        """Refuse further operations and release handles. Values stay: in the disk tier,
        and in the memory tier while another process uses it.

        The last process using the memory tier (:mod:`.memory_tiers`) shrinks it to
        ``memory_keep_bytes`` of its most recently used segments: the values of the
        others are written to the disk tier first (for at most ``spill_s`` seconds,
        :data:`EXIT_SPILL_S` by default: the connector closes its stores at exit right
        after the dump scheduler's exit flush), their files removed; with 0 (the default)
        the tier itself is removed, so no RAM stays behind in the tmpfs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
