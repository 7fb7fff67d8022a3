"""The shared index of one tier: which segment holds which key, and who writes where.

Kept in LMDB (``lmdb`` on PyPI): a memory-mapped B-tree that many processes read without
locks and write one transaction at a time, whose transactions are atomic and survive a
writer killed at any point (robust mutexes; a dead reader's slot is reclaimed with
``reader_check``). That is every property the index needs, so it is not written here:
docs/CONNECTOR.md#store compares it with keeping the values themselves in LMDB.

Four tables:

* ``keys``: 16-byte key digest -> :data:`LOC` (segment, generation, offset, frame bytes);
* ``segs``: segment number -> :data:`SEG` (generation, published end, owner pid);
* ``held``: (segment, offset of a published batch) -> the digests of that batch, so that
  emptying a segment finds its entries (to spill them, then delete them) without reading
  the segment itself. One row per publish: a publish adds a row, it never rewrites the
  segment's list;
* ``meta``: segment size and count, fixed for the directory, and the index format.

A segment's generation goes up each time it is emptied for reuse; a location whose
generation is not its segment's current one is stale (a value evicted with its segment)
and reads as missing, so a reader never needs the eviction's deletes to be done. The
owner is the pid that appends to the segment (0: none); a segment owned by a dead pid
is free to take (a writer killed mid-write leaves only its unpublished tail behind).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import lmdb

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.ownership import (
    ForeignFile,
    check_entries,
    open_dir,
    open_file,
    refusal,
)

log = logging.getLogger(__name__)

LOC = struct.Struct("<IQQI")  # segment, generation, offset, frame bytes (header + payload)
SEG = struct.Struct("<QQI")  # generation, published end, owner pid
DIGEST = 16  # bytes of a key digest: ``held`` rows are digests end to end
_META = struct.Struct("<QQ")  # segment bytes, segment count
_SEG_KEY = struct.Struct(">I")  # big-endian: LMDB's byte order is the numeric order
_HELD_KEY = struct.Struct(">IQ")  # segment, batch offset: a segment's rows are adjacent
_SEG_GEN = struct.Struct("<IQ")  # the first 12 bytes of a LOC: which (segment, generation)
FORMAT = b"2"  # ``held`` rows per publish; an index of another format starts empty
MIN_MAP_BYTES = 1 << 20
# Room for pages LMDB cannot reuse yet: a page freed by a write is reused only once every
# reader that started before it is done, and a reader preempted in a busy host holds its
# snapshot while other processes commit hundreds of transactions (4 writers on 2 cores
# filled a 1 MiB index holding 40 entries).
SPARE_MAP_BYTES = 8 << 20
MAX_READERS = 4096
_T = TypeVar("_T")


class Loc(NamedTuple):
    seg: int
    gen: int
    offset: int
    size: int


class SegRow(NamedTuple):
    gen: int
    end: int
    owner: int


_ERRNO_OF = {os.strerror(e): e for e in sorted(errno.errorcode, reverse=True)}


def as_os_error(exc: lmdb.Error) -> OSError:
    """The OSError an LMDB error stands for (py-lmdb keeps only the message), so that the
    callers' ENOSPC / EROFS handling applies to the index as to the segments."""
    text = str(exc)
    if isinstance(exc, lmdb.ReadonlyError):
        return OSError(errno.EROFS, os.strerror(errno.EROFS))
    if isinstance(exc, lmdb.MapFullError):  # the index is full: emptying segments frees it
        return OSError(errno.ENOSPC, f"index full: {text}")
    for message, code in _ERRNO_OF.items():
        if text.endswith(message):
            return OSError(code, message)
    return OSError(errno.EIO, text)


def _guarded(fn: Callable[..., _T]) -> Callable[..., _T]:
    """LMDB errors leave an index method as StoreError, caused by their OSError."""

    @functools.wraps(fn)
    def call(self: SegmentIndex, *args: object, **kwargs: object) -> _T:
        try:
            try:
                return fn(self, *args, **kwargs)
            except lmdb.MapFullError:
                # A process killed inside a read transaction (a cleaner, a writer) leaves
                # its reader slot behind, and every page freed since stays unusable: the
                # map fills with pages nobody reads. Its slot cleared, the (aborted)
                # transaction runs once more.
                if not self._clear_dead_readers():
                    raise
                return fn(self, *args, **kwargs)
        except lmdb.Error as exc:
            raise StoreError(f"store index {self.path!r}: {exc}") from as_os_error(exc)

    return call


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _spare_room(path: str) -> int:
    """:data:`SPARE_MAP_BYTES`, or an eighth of a file system smaller than eight times that
    (the index file is allocated in full, and must not take a small tmpfs for itself)."""
    try:  # fstatvfs: the store's capacity check owns the one statvfs of its directory
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            vfs = os.fstatvfs(fd)
        finally:
            os.close(fd)
    except OSError:
        return MIN_MAP_BYTES
    return min(SPARE_MAP_BYTES, vfs.f_blocks * vfs.f_frsize // 8) & ~4095


class SegmentIndex:
    """LMDB tables of one tier directory (``<dir>/index``), shared by every process."""

    def __init__(
        self, tier_path: str, dir_mode: int, file_mode: int, sync: bool, map_bytes: int
    ) -> None:
        self.path = os.path.join(tier_path, "index")
        self.map_bytes = max(MIN_MAP_BYTES, map_bytes, _spare_room(tier_path))
        self.sync = sync
        self._dir_mode = dir_mode
        self._file_mode = file_mode
        self._pid = os.getpid()
        self.read_only = False
        self._open_env()

    def _clear_dead_readers(self) -> int:
        """Reader slots of processes that died, cleared (LMDB ``reader_check``): how many."""
        try:
            return int(self._env.reader_check())
        except lmdb.Error:
            return 0

    @_guarded
    def _open_env(self) -> None:
        """Open (or share) the environment; one that LMDB finds damaged (a crash without
        fsync on a power cut, a foreign file) is removed and started empty, with a warning."""
        self._refuse_links()
        self._env = _shared_env(self.path, self._lmdb)
        self.read_only = bool(self._env.flags()["readonly"])
        self._keys = self._env.open_db(b"keys")
        self._segs = self._env.open_db(b"segs")
        self._held = self._env.open_db(b"held")
        self._meta = self._env.open_db(b"meta")

    def _refuse_links(self) -> None:
        """Create ``index/`` (owner only); a symlink in place of it or of its files is
        never followed: the directory is refused, a file link removed."""
        # made here, or this user's and writable by nobody else; never a link (ownership)
        fd = open_dir(self.path, self._dir_mode, "store index")[0]
        try:
            for name in ("data.mdb", "lock.mdb"):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    log.warning("store index: not following %s/%s: removed", self.path, name)
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def _lmdb(self) -> lmdb.Environment:
        try:
            return self._open_lmdb()
        except (lmdb.CorruptedError, lmdb.InvalidError, lmdb.VersionMismatchError) as exc:
            log.warning("store index %s damaged (%s): starting it empty", self.path, exc)
        shutil.rmtree(self.path, ignore_errors=True)
        self._refuse_links()
        return self._open_lmdb()

    def _open_lmdb(self, writemap: bool = True) -> lmdb.Environment:
        self._create_files()
        try:
            env = lmdb.open(
                self.path,
                map_size=self.map_bytes,
                max_dbs=5,
                max_readers=MAX_READERS,
                sync=self.sync,
                metasync=self.sync,
                readahead=False,
                # pages changed in place in the shared mapping: no write() of every dirty
                # page at each commit (a third of a put's time without it). The data file
                # is allocated in full first (_allocate): a store into the mapping then
                # never meets a full disk, which would be a SIGBUS.
                writemap=writemap,
                mode=self._file_mode,
            )
        except lmdb.Error as exc:
            if as_os_error(exc).errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # a read-only directory: serve what it holds; every write raises EROFS
            return lmdb.open(self.path, max_dbs=5, readonly=True, lock=False)
        env.reader_check()  # slots of readers that died
        if writemap:
            try:
                self._allocate()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                log.warning(
                    "store index %s: no room to allocate %d bytes (%s): written with "
                    "write() instead of in place (slower, and safe on a full disk)",
                    self.path,
                    self.map_bytes,
                    exc,
                )
                env.close()
                return self._open_lmdb(writemap=False)
        return env

    def _allocate(self) -> None:
        """Allocate the data file in full (LMDB made it as large as the map, sparse): a
        store into a hole of the mapping on a full disk would be a SIGBUS, an allocation
        now is an ENOSPC. Safe to open and close here: LMDB locks only ``lock.mdb``."""
        fd = os.open(os.path.join(self.path, "data.mdb"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_blocks * 512 < st.st_size:
                os.posix_fallocate(fd, 0, st.st_size)
        finally:
            os.close(fd)

    def _create_files(self) -> None:
        """Create LMDB's two files with the configured mode (the umask would cut it), or
        fix the mode of existing ones. Only before this process opens the environment:
        closing any descriptor of ``lock.mdb`` drops every POSIX lock the process holds on
        it, LMDB's included, and another process would then reset the lock table."""
        dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in ("data.mdb", "lock.mdb"):
                where = os.path.join(self.path, name)
                try:  # created exclusively, checked once open (ownership)
                    fd = open_file(name, dir_fd, where, self._file_mode, create=True)[0]
                except ForeignFile as exc:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    raise refusal("store index", where, st, exc.strerror, "file") from None
                except OSError as exc:
                    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                        # a read-only directory: opened read-only below, once checked
                        check_entries(dir_fd, self.path, [name], self._file_mode, "store index")
                        continue
                    raise
                try:
                    st = os.fstat(fd)
                    if stat.S_IMODE(st.st_mode) != self._file_mode:
                        os.fchmod(fd, self._file_mode)
                finally:
                    os.close(fd)
        finally:
            os.close(dir_fd)

    def _check_fork(self) -> None:
        """LMDB handles must not cross fork(): a child reopens the environment."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._open_env()

    # -- meta -------------------------------------------------------------------------------

    @_guarded
    def layout(self, segment_bytes: int, count: int) -> tuple[int, int, tuple[int, int] | None]:
        """The directory's (segment bytes, count), and what it recorded before (None when
        new). The segment size is the directory's for ever; the count follows the last
        process that started (one capacity per tier)."""
        self._check_fork()
        with self._env.begin(write=not self.read_only, db=self._meta) as txn:
            if not self.read_only and txn.get(b"format") != FORMAT:
                for db in (self._keys, self._segs, self._held):
                    txn.drop(db, delete=False)  # a cache of another format: misses
                txn.put(b"format", FORMAT)
            raw = txn.get(b"layout")
            previous = _META.unpack(raw) if raw is not None and len(raw) == _META.size else None
            if previous is not None:
                segment_bytes = previous[0]
            if not self.read_only:
                txn.put(b"layout", _META.pack(segment_bytes, count))
        return segment_bytes, count, previous

    # -- reads ------------------------------------------------------------------------------

    @_guarded
    def lookup(self, digests: Sequence[bytes]) -> list[Loc | None]:
        """Current locations per digest (None: missing, or evicted with its segment)."""
        self._check_fork()
        out: list[Loc | None] = []
        gens: dict[int, int] = {}
        with self._env.begin() as txn:
            found = dict(txn.cursor(db=self._keys).getmulti(digests))
            for d in digests:
                raw = found.get(d)
                if raw is None:
                    out.append(None)
                    continue
                loc = Loc(*LOC.unpack(raw))
                gen = gens.get(loc.seg)
                if gen is None:
                    row = txn.get(_SEG_KEY.pack(loc.seg), db=self._segs)
                    gen = gens[loc.seg] = SEG.unpack(row)[0] if row is not None else -1
                out.append(loc if gen == loc.gen else None)
        return out

    @_guarded
    def current(self, locs: Sequence[Loc]) -> list[bool]:
        """True per location whose segment has not been emptied since it was looked up."""
        self._check_fork()
        gens: dict[int, int] = {}
        with self._env.begin(db=self._segs) as txn:
            for seg in {loc.seg for loc in locs}:
                row = txn.get(_SEG_KEY.pack(seg))
                gens[seg] = SEG.unpack(row)[0] if row is not None else -1
        return [gens[loc.seg] == loc.gen for loc in locs]

    @_guarded
    def segments(self) -> dict[int, SegRow]:
        self._check_fork()
        with self._env.begin(db=self._segs) as txn:
            return {_SEG_KEY.unpack(k)[0]: SegRow(*SEG.unpack(v)) for k, v in txn.cursor()}

    @_guarded
    def held(self, seg: int, gen: int) -> list[tuple[bytes, int, int]]:
        """(digest, offset, frame bytes) of the entries published into (seg, gen) that
        still point there."""
        self._check_fork()
        with self._env.begin() as txn:
            digests = self._members(txn, seg)
            where = _SEG_GEN.pack(seg, gen)
            out = []
            for digest, raw in txn.cursor(db=self._keys).getmulti(digests):
                if raw[:12] == where:
                    _seg, _gen, offset, size = LOC.unpack(raw)
                    out.append((bytes(digest), offset, size))
        return out

    def _members(self, txn: lmdb.Transaction, seg: int) -> list[bytes]:
        """The digests published into ``seg`` (any generation since it was last emptied)."""
        start = _SEG_KEY.pack(seg)
        cursor = txn.cursor(db=self._held)
        rows = []
        if cursor.set_range(start):
            for key, value in cursor:
                if key[:4] != start:
                    break
                rows.append(value)
        blob = b"".join(rows)
        return [blob[i : i + DIGEST] for i in range(0, len(blob), DIGEST)]

    def _drop_members(self, txn: lmdb.Transaction, seg: int) -> None:
        start = _SEG_KEY.pack(seg)
        cursor = txn.cursor(db=self._held)
        if cursor.set_range(start):
            while cursor.key()[:4] == start:
                if not cursor.delete():
                    break

    @_guarded
    def entries(self) -> list[tuple[bytes, Loc]]:
        """Every current (digest, location): a scan, for tools and tests."""
        self._check_fork()
        with self._env.begin() as txn:
            gens = {_SEG_KEY.unpack(k)[0]: SEG.unpack(v)[0] for k, v in txn.cursor(db=self._segs)}
            out = []
            for k, v in txn.cursor(db=self._keys):
                loc = Loc(*LOC.unpack(v))
                if gens.get(loc.seg) == loc.gen:
                    out.append((bytes(k), loc))
        return out

    @_guarded
    def count(self) -> tuple[int, int]:
        """(current entries, published bytes of current segments): a scan, for tools."""
        self._check_fork()
        with self._env.begin() as txn:
            rows = {_SEG_KEY.unpack(k)[0]: SEG.unpack(v) for k, v in txn.cursor(db=self._segs)}
            n = 0
            for _k, v in txn.cursor(db=self._keys):
                seg, gen = LOC.unpack(v)[:2]
                row = rows.get(seg)
                n += row is not None and row[0] == gen
        return n, sum(r[1] for r in rows.values())

    # -- writes -----------------------------------------------------------------------------

    @_guarded
    def claim(self, seg: int, expect: SegRow | None, owner: int, empty: bool) -> int | None:
        """Take ``seg`` for ``owner`` if its row is still ``expect`` (compare-and-set across
        processes). ``empty``: start it over (generation + 1, nothing published), which
        makes every entry into it stale. The generation now, or None when someone else
        took it first."""
        self._check_fork()
        key = _SEG_KEY.pack(seg)
        with self._env.begin(write=True, db=self._segs) as txn:
            raw = txn.get(key)
            row = SegRow(*SEG.unpack(raw)) if raw is not None else None
            if row != expect:
                return None
            gen = (row.gen if row else 0) + (1 if empty or row is None else 0)
            end = 0 if empty or row is None else row.end
            txn.put(key, SEG.pack(gen, end, owner))
            if empty:
                self._drop_members(txn, seg)
        return gen

    @_guarded
    def empty(self, seg: int, expect: SegRow, owner: int) -> tuple[int, int] | None:
        """Start ``seg`` over for ``owner`` (0: nobody's, ready for any writer) if its row
        is still ``expect``: generation + 1, nothing published, and the entries that
        pointed into it deleted, all in one transaction. (the new generation, entries
        deleted), or None when someone else took it first."""
        self._check_fork()
        key = _SEG_KEY.pack(seg)
        with self._env.begin(write=True) as txn:
            raw = txn.get(key, db=self._segs)
            row = SegRow(*SEG.unpack(raw)) if raw is not None else None
            if row != expect:
                return None
            gen = (row.gen if row else 0) + 1
            txn.put(key, SEG.pack(gen, 0, owner), db=self._segs)
            dropped = 0
            if row is not None:
                where = _SEG_GEN.pack(seg, row.gen)
                keys = txn.cursor(db=self._keys)
                stale = [d for d, v in keys.getmulti(self._members(txn, seg)) if v[:12] == where]
                for digest in stale:  # (Cursor.delete takes no key: it deletes where it is)
                    txn.delete(digest, db=self._keys)  # index space back; readers need not
                dropped = len(stale)
                self._drop_members(txn, seg)
        return gen, dropped

    @_guarded
    def release(self, seg: int, gen: int, owner: int) -> None:
        """Give up appending to ``seg`` (if still ours) so that it can be evicted."""
        self._check_fork()
        key = _SEG_KEY.pack(seg)
        with self._env.begin(write=True, db=self._segs) as txn:
            raw = txn.get(key)
            if raw is not None:
                row = SegRow(*SEG.unpack(raw))
                if row.gen == gen and row.owner == owner:
                    txn.put(key, SEG.pack(row.gen, row.end, 0))

    @_guarded
    def publish(
        self,
        seg: int,
        gen: int,
        owner: int,
        locs: Sequence[tuple[bytes, bytes]],
        start: int,
        end: int,
        release: bool = False,
    ) -> bool:
        """Make ``locs`` (digest, :data:`LOC` packed) of one batch written at ``start`` in
        (seg, gen) visible at once, and with ``release`` give the segment up in the same
        transaction.

        A digest that already has a current entry keeps it (the first value wins). False,
        publishing nothing, when the segment is no longer this owner's (taken as dead)."""
        self._check_fork()
        key = _SEG_KEY.pack(seg)
        with self._env.begin(write=True) as txn:
            raw = txn.get(key, db=self._segs)
            if raw is None:
                return False
            row = SegRow(*SEG.unpack(raw))
            if row.gen != gen or row.owner != owner:
                return False
            keys = txn.cursor(db=self._keys)
            if keys.putmulti(locs, overwrite=False)[1] < len(locs):
                self._replace_stale(txn, keys, locs)
            if locs:  # a batch of none: only the release
                txn.put(_HELD_KEY.pack(seg, start), b"".join([d for d, _loc in locs]),
                        db=self._held)  # fmt: skip
            txn.put(key, SEG.pack(gen, max(end, row.end), 0 if release else owner), db=self._segs)
        return True

    def _replace_stale(
        self, txn: lmdb.Transaction, keys: lmdb.Cursor, locs: Sequence[tuple[bytes, bytes]]
    ) -> None:
        """Some digests of a publish had entries: an entry into an emptied segment is stale
        and replaced, a current one stays (the first value wins)."""
        gens: dict[int, int] = {}
        for digest, loc in locs:
            old = keys.get(digest)
            if old == loc:
                continue
            oseg, ogen = _SEG_GEN.unpack_from(old)
            cur = gens.get(oseg)
            if cur is None:
                orow = txn.get(_SEG_KEY.pack(oseg), db=self._segs)
                cur = gens[oseg] = SEG.unpack(orow)[0] if orow is not None else -1
            if cur != ogen:
                keys.put(digest, loc)

    @_guarded
    def drop(self, digest: bytes, loc: Loc) -> None:
        """Remove ``digest``'s entry if it still points at ``loc`` (a corrupt value)."""
        self._check_fork()
        with self._env.begin(write=True, db=self._keys) as txn:
            raw = txn.get(digest)
            if raw is not None and Loc(*LOC.unpack(raw)) == loc:
                txn.delete(digest)

    @_guarded
    def remove(self, digests: Sequence[bytes]) -> int:
        """Delete the entries of ``digests`` whatever they point at: entries removed."""
        self._check_fork()
        with self._env.begin(write=True, db=self._keys) as txn:
            return sum(bool(txn.delete(d)) for d in digests)

    @_guarded
    def remove_all(self) -> None:
        self._check_fork()
        with self._env.begin(write=True) as txn:
            txn.drop(self._keys, delete=False)

    @_guarded
    def flush(self) -> None:
        if self.sync:
            self._env.sync(True)

    def close(self) -> None:
        _release_env(self.path)


# LMDB allows one Environment per file per process; stores (and tiers) opened twice on one
# directory in a process share it. Keyed by pid too: a forked child opens its own.
_envs: dict[tuple[int, str], list] = {}
_envs_lock = threading.Lock()


def _shared_env(path: str, opener: Callable[[], lmdb.Environment]) -> lmdb.Environment:
    key = (os.getpid(), os.path.realpath(path))
    with _envs_lock:
        found = _envs.get(key)
        if found is None:
            found = _envs[key] = [opener(), 0]
        found[1] += 1
        return found[0]


def _release_env(path: str) -> None:
    key = (os.getpid(), os.path.realpath(path))
    with _envs_lock:
        found = _envs.get(key)
        if found is None:
            return
        found[1] -= 1
        if found[1] > 0:
            return
        del _envs[key]
    try:
        found[0].close()
    except lmdb.Error:
        pass


__all__ = ["LOC", "SEG", "Loc", "SegRow", "SegmentIndex", "pid_alive"]
