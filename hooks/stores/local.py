"""The embedded default store: one file per value in a local directory.

Why files: on one machine, write + rename without fsync matches or beats Mooncake and Redis
(see docs/BENCHMARKS.md), needs no server, and survives a restart of vLLM, so a new process
on the same directory sees the existing values.

Layout: ``<root>/<digest[:2]>/<digest>`` where ``digest`` is a 128-bit blake2b of the key
(keys may hold any characters; 256 shard directories keep directories small). Each file is
an integrity frame (:mod:`ucm_patch.hooks.stores.framing`) followed by the payload.
``<root>/.ucm_ledger`` holds the bytes in use and is the lock all processes share.

Several processes (vLLM workers, restarts, other instances) may use one directory at once,
so the directory is the only truth; nothing kept in memory answers a question about it:

* ``exists_many`` and a put of a key that is already there look at the file itself; a put
  answers True only once its file is in place (or another writer's is).
* Writes go to a hidden temp file in the same shard, then ``os.link`` to the final name (an
  existing file makes the link fail: the first value wins without double counting), then
  the temp name is removed. A reader sees a whole file or none. ``fsync=True`` also syncs
  the file and the shard directory (crash durability at about half the write speed).
* Every read checks the frame. A mismatch, a truncated file, or anything that is not a
  regular file (a planted symlink) is counted in ``stats["corrupt"]``, removed and not
  served. A value evicted while it was being read is a miss, not a hit.
* Capacity is one limit per directory, across processes: the ledger (bytes used) is updated
  under ``fcntl.flock`` on every put and removal. A put that does not fit scans the shards,
  evicts the least recently used files (by mtime; a hit refreshes it) down to 90 % of the
  capacity so that scans stay rare, and stores the real total it counted in the ledger,
  which heals drift left by a crash or by files removed behind the store's back. A value
  larger than the whole capacity is skipped (False).
* Different capacities for one directory: each process enforces its own against the shared
  ledger, so a process configured smaller evicts down to its own limit whenever it writes
  (the smallest capacity among the writers governs). The ledger records the last capacity a
  process started with; a process starting with another one logs a warning.
* The default capacity (none configured) is 10 GiB capped at start by the free space plus
  the bytes already stored there. A full disk (ENOSPC) anyway evicts at least the value's
  size and 10 % of what is stored, then retries once; if it still fails, StoreError.
* Owner only by default: new directories 0700, files 0600 (``dir_mode`` / ``file_mode``).
  Value files are opened with ``O_NOFOLLOW`` and shard directories are only reached through
  descriptors opened with ``O_NOFOLLOW | O_DIRECTORY``, so a symlink planted in the tree is
  never followed, neither by reads nor by eviction.
* With ``UCM_PATCH_STORE_KEY`` (or ``UCM_PATCH_STORE_KEY_FILE``) set, values carry a keyed
  frame and a value written without the key is rejected like a corrupt one.
* Disk errors (read-only EROFS, permissions EACCES, ENOSPC after the retry) raise
  :class:`StoreError` from ``put_many``; the temp file is removed, nothing crashes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    key_bytes,
    load_store_key,
    make_header,
    payload_length,
    verify,
)

log = logging.getLogger(__name__)

# A temp file older than this belongs to a writer that died mid-write.
TMP_GRACE_S = 600.0
DEFAULT_CAPACITY = 10 << 30
LOW_WATER = 0.9  # eviction frees down to this fraction, so one scan serves many puts
LEDGER_NAME = ".ucm_ledger"
_LEDGER = struct.Struct("<8sQQ")  # magic, bytes used, capacity of the last process started
_LEDGER_MAGIC = b"UCMledg1"
_HEX = frozenset("0123456789abcdef")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_SHARD_FLAGS = _DIR_FLAGS | os.O_NOFOLLOW
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def _read_exact(fd: int, n: int) -> bytes:
    """Read ``n`` bytes (fewer only at end of file). Unbuffered: one copy into ``bytes``."""
    data = os.read(fd, n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n and (chunk := os.read(fd, n - got)):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (preadv: straight into the caller's memory).
    CorruptValue when the file ends first (truncated since its size was checked)."""
    got, n = 0, len(buf)
    while got < n:
        k = os.preadv(fd, [buf[got:]], offset + got)
        if k == 0:
            raise CorruptValue(f"file ended after {got} of {n} payload bytes")
        got += k


def _write_all(fd: int, header: bytes, payload: memoryview) -> None:
    """Write header + payload with as few syscalls as the kernel allows (writev)."""
    bufs: list[bytes | memoryview] = [header, payload]
    while bufs:
        n = os.writev(fd, bufs)
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if bufs and n:
            bufs[0] = memoryview(bufs[0])[n:]


def _is_digest(name: str) -> bool:
    return len(name) == 32 and _HEX.issuperset(name)


def _is_temp(name: str) -> bool:
    """Names written by :meth:`LocalStore._attempt`: ``.<digest>.<pid>.<tid>.<n>.<size>.tmp``."""
    return name.startswith(".") and name.endswith(".tmp") and _is_digest(name[1:33])


def _temp_size(name: str, st: os.stat_result) -> int:
    """The bytes a temp file will hold: its name says (it is counted before it is written)."""
    parts = name[1:-4].split(".")
    if len(parts) == 5 and parts[4].isdigit():
        return max(int(parts[4]), st.st_size)
    return st.st_size


class LocalStore(KVStore):
    """A directory of checksummed value files with one LRU capacity shared by processes."""

    name = "local"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        fsync: bool = False,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> None:
        super().__init__()
        self.stats["disk_full"] = 0  # ENOSPC that made the store evict and retry
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.fsync = fsync
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._lock = threading.Lock()  # flock is per open file, so threads need their own
        self._fd_lock = threading.Lock()  # guards _shards; taken inside _lock, never around it
        self._shards: dict[str, int] = {}  # shard name -> descriptor opened with O_NOFOLLOW
        self._closed = False
        self._tmp_seq = itertools.count()
        self._warn = RateLimitedLog(log, 30.0)
        try:
            self._secret = load_store_key()
        except ValueError as exc:
            raise StoreError(f"local store: {exc}") from exc
        try:
            if not os.path.isdir(self.path):
                os.makedirs(self.path, mode=dir_mode, exist_ok=True)
                if dir_mode & 0o077:
                    os.chmod(self.path, dir_mode)  # the umask may have cut group bits
            self._root = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            raise StoreError(f"local store: cannot create directory {self.path!r}: {exc}") from exc
        self._ledger_writable = True
        self._ledger = self._open_ledger()
        self._lock_fd = self._root if self._ledger is None else self._ledger
        self.capacity_bytes = capacity_bytes or DEFAULT_CAPACITY
        self._start(capped=capacity_bytes is None)

    # -- start-up -------------------------------------------------------------------------

    def _open_ledger(self) -> int | None:
        """The shared ledger / lock file; None on a read-only directory without one
        (reads still work, the directory descriptor is locked instead)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(LEDGER_NAME, flags, self.file_mode, dir_fd=self._root)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                err = f"local store: cannot open {LEDGER_NAME} in {self.path!r}: {exc}"
                raise StoreError(err) from exc
            self._ledger_writable = False
            try:
                return os.open(LEDGER_NAME, _READ_FLAGS, dir_fd=self._root)
            except OSError:
                return None
        if self.file_mode & 0o077:
            os.fchmod(fd, self.file_mode)
        return fd

    def _start(self, capped: bool) -> None:
        """Count what is stored (healing the ledger), cap a default capacity by the free
        space, drop stale temp files and evict down to a capacity lowered since last run."""
        with self._locked():
            previous = self._read_ledger_full()
            total = self._scan_total(reap=True)
            if capped:
                try:
                    vfs = os.statvfs(self._root)
                    room = vfs.f_bavail * vfs.f_frsize + total
                except OSError:
                    room = self.capacity_bytes
                if room < self.capacity_bytes:
                    self.capacity_bytes = max(room, 1)
                    log.info(
                        "local store %s: default capacity capped at %d bytes (free space "
                        "plus %d bytes already stored)",
                        self.path,
                        self.capacity_bytes,
                        total,
                    )
            if previous is not None and previous[1] not in (0, self.capacity_bytes):
                log.warning(
                    "local store %s: the previous process started on it used capacity %d "
                    "bytes, this one %d; while both write, each evicts down to its own limit",
                    self.path,
                    previous[1],
                    self.capacity_bytes,
                )
            if total > self.capacity_bytes:
                total = self._evict_locked(self._low_water(), 0)
            self._write_ledger(total)

    # -- helpers --------------------------------------------------------------------------

    def _file(self, digest: str) -> str:
        return os.path.join(self.path, digest[:2], digest)

    @staticmethod
    def _digest(kb: bytes) -> str:
        return hashlib.blake2b(kb, digest_size=16).hexdigest()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"local store {self.path!r} is closed")

    def _low_water(self) -> int:
        return int(self.capacity_bytes * LOW_WATER)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads and every other process on the directory, in that order."""
        with self._lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_ledger_full(self) -> tuple[int, int] | None:
        """(bytes used, capacity) from the ledger, None when missing or unreadable (lock held)."""
        if self._ledger is None:
            return None
        try:
            raw = os.pread(self._ledger, _LEDGER.size, 0)
        except OSError:
            return None
        if len(raw) != _LEDGER.size:
            return None
        magic, used, capacity = _LEDGER.unpack(raw)
        return (used, capacity) if magic == _LEDGER_MAGIC else None

    def _write_ledger(self, used: int) -> None:
        """Record ``used`` bytes (lock held). Best effort: on a read-only directory the
        ledger cannot change, and nothing can be written there either."""
        if self._ledger is None or not self._ledger_writable:
            return
        data = _LEDGER.pack(_LEDGER_MAGIC, max(used, 0), self.capacity_bytes)
        try:
            os.pwrite(self._ledger, data, 0)
        except OSError as exc:
            self._warn.warning(("ledger", exc.errno), "local store %s: ledger: %s", self.path, exc)

    def _shard(self, name: str, create: bool) -> int | None:
        """A descriptor of shard directory ``name``, never through a symlink.

        None when it does not exist (and ``create`` is false) or is not a real directory;
        with ``create`` the latter raises :class:`StoreError`.
        """
        fd = self._shards.get(name)
        if fd is not None:
            return fd
        try:
            fd = os.open(name, _SHARD_FLAGS, dir_fd=self._root)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, self.dir_mode, dir_fd=self._root)
                if self.dir_mode & 0o077:
                    os.chmod(name, self.dir_mode, dir_fd=self._root, follow_symlinks=False)
            except FileExistsError:
                pass  # another process or thread created it meanwhile
            except OSError as exc:
                raise StoreError(f"local store: cannot create shard {name!r}: {exc}") from exc
            return self._shard(name, create=False)
        except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where a shard belongs
            where = os.path.join(self.path, name)
            if create:
                raise StoreError(
                    f"local store: {where!r} is not a directory (a symlink?): {exc}"
                ) from exc
            self._warn.warning(("shard", name), "local store: not following %s: %s", where, exc)
            return None
        with self._fd_lock:
            if name in self._shards:  # another thread opened it first
                os.close(fd)
                return self._shards[name]
            self._shards[name] = fd
        return fd

    def _stale_shard(self, name: str, fd: int) -> bool:
        """True (and the cached descriptor dropped) when the shard was deleted since it was
        opened: a new one of that name may hold values written since."""
        try:
            gone = os.fstat(fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            with self._fd_lock:
                if self._shards.get(name) == fd:
                    del self._shards[name]
                    os.close(fd)
        return gone

    def _scan(self, reap: bool) -> tuple[list[tuple[int, str, str, int]], int]:
        """Every value file as (mtime_ns, shard, name, size) and the bytes in use, temp files
        in flight counted at their final size (lock held). ``reap`` removes stale temps."""
        values: list[tuple[int, str, str, int]] = []
        total = 0
        now = time.time()
        try:
            with os.scandir(self._root) as it:
                names = [e.name for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            raise StoreError(f"local store: cannot list {self.path!r}: {exc}") from exc
        for shard in names:
            if not _HEX.issuperset(shard):
                continue
            sfd = self._shard(shard, create=False)
            if sfd is None:
                continue
            try:
                with os.scandir(sfd) as it:
                    entries = list(it)
            except OSError as exc:
                raise StoreError(f"local store: cannot list shard {shard!r}: {exc}") from exc
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile by another process
                if not stat.S_ISREG(st.st_mode):
                    continue
                if _is_digest(entry.name) and entry.name[:2] == shard:
                    values.append((st.st_mtime_ns, shard, entry.name, st.st_size))
                    total += st.st_size
                elif _is_temp(entry.name):
                    if reap and now - st.st_mtime > TMP_GRACE_S:
                        self._unlink_quietly(sfd, entry.name)
                    else:
                        total += _temp_size(entry.name, st)
        return values, total

    def _scan_total(self, reap: bool = False) -> int:
        return self._scan(reap)[1]

    def _evict_locked(self, limit: int, incoming: int, trigger: int | None = None) -> int:
        """If the real total plus ``incoming`` exceeds ``trigger`` (default ``limit``),
        remove least recently used values until it is at most ``limit``. Returns the real
        total afterwards (lock held; the caller records it). A ledger that drifted high
        thus costs one scan, not an eviction."""
        values, total = self._scan(reap=True)
        if total + incoming <= (limit if trigger is None else trigger):
            return total
        values.sort()
        for _mtime, shard, name, size in values:
            if total + incoming <= limit:
                break
            sfd = self._shard(shard, create=False)
            if sfd is not None and self._unlink_quietly(sfd, name):
                self.stats["evictions"] += 1
            total -= size  # gone either way: removed now or by another process before
        return total

    def _unlink_quietly(self, sfd: int, name: str) -> bool:
        """Best-effort removal of an evicted, temp or corrupt file; True when removed.

        Best effort: in a read-only directory eviction must not fail reads; the file stays
        on disk (a put there fails on its own)."""
        try:
            os.unlink(name, dir_fd=sfd)
        except FileNotFoundError:
            return False  # already gone (another process evicted or replaced it)
        except OSError as exc:
            self._warn.warning(
                ("unlink", exc.errno), "local store %s: cannot remove %s: %s", self.path, name, exc
            )
            return False
        return True

    def _release(self, size: int) -> None:
        """Give back ``size`` bytes in the ledger (a failed write, a removed value)."""
        with self._locked():
            found = self._read_ledger_full()
            if found is not None:
                self._write_ledger(found[0] - size)

    def _forget(self, digest: str) -> None:
        """Nothing to do: no index is kept. A file removed behind the store's back only
        leaves the ledger high until the next eviction scan counts the real total."""

    # -- writes ---------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> list[bool]:
        """Store values (first value per key wins); False when larger than the capacity."""
        self._check_open()
        results: list[bool] = []
        try:
            for key, value in items:
                results.append(self._put_one(key, value))
        except StoreError:
            with self._lock:
                self.stats["errors"] += 1
            raise
        return results

    def _put_one(self, key: str, value: bytes | bytearray | memoryview) -> bool:
        kb = key_bytes(key)
        payload = as_bytes_view(value)
        digest = self._digest(kb)
        size = HEADER_SIZE + len(payload)
        with self._lock:
            self.stats["puts"] += 1
            if size > self.capacity_bytes:
                self.stats["skipped_full"] += 1
                return False
        shard = digest[:2]
        sfd = self._shard(shard, create=True)
        if sfd is None:
            raise StoreError(f"local store: shard {shard!r} of {self.path!r} vanished")
        if self._is_value(sfd, digest):
            return True  # written by another process or before a restart: first value wins
        header = make_header(kb, payload, self._secret)
        retried = False
        while True:
            try:
                stored = self._attempt(sfd, digest, header, payload, size)
                break
            except FileNotFoundError as exc:  # the shard was deleted since it was opened
                if retried or not self._stale_shard(shard, sfd):
                    final = self._file(digest)
                    raise StoreError(f"local store: cannot write {final!r}: {exc}") from exc
                sfd = self._shard(shard, create=True)  # type: ignore[assignment]
                retried = True
            except OSError as exc:
                if exc.errno != errno.ENOSPC or retried:
                    final = self._file(digest)
                    raise StoreError(f"local store: cannot write {final!r}: {exc}") from exc
                self._relieve_disk(size, exc)
                retried = True
        if stored:
            with self._lock:
                self.stats["bytes_written"] += len(payload)
        return True

    def _is_value(self, sfd: int, digest: str) -> bool:
        """A regular file (not a symlink, not a directory) under ``digest`` in the shard."""
        try:
            st = os.stat(digest, dir_fd=sfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"local store: cannot stat {self._file(digest)!r}: {exc}") from exc
        return stat.S_ISREG(st.st_mode)

    def _attempt(
        self, sfd: int, digest: str, header: bytes, payload: memoryview, size: int
    ) -> bool:
        """One write: temp file, reserve in the ledger, write, link. True when this call
        stored the value, False when another writer's file won. OSError on failure, with the
        temp file removed and the reservation given back."""
        tmp = f".{digest}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}.{size}.tmp"
        fd = os.open(tmp, _TMP_FLAGS, self.file_mode, dir_fd=sfd)  # counted by scans from now
        reserved = False
        try:
            try:
                if self.file_mode & 0o077:
                    os.fchmod(fd, self.file_mode)
                self._reserve(size)
                reserved = True
                _write_all(fd, header, payload)
                now = time.time_ns()  # explicit: file times are only jiffy-precise otherwise
                os.utime(fd, ns=(now, now))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            won = self._link(sfd, tmp, digest)
            if not won:
                self._release(size)
            elif self.fsync:
                os.fsync(sfd)
            return won
        except BaseException:
            if reserved:
                self._release(size)
            raise
        finally:
            self._unlink_quietly(sfd, tmp)

    def _link(self, sfd: int, tmp: str, digest: str) -> bool:
        """Give the temp file its final name unless a value is already there."""
        for _ in range(2):
            try:
                os.link(tmp, digest, src_dir_fd=sfd, dst_dir_fd=sfd, follow_symlinks=False)
                return True
            except FileExistsError:
                if self._is_value(sfd, digest):
                    return False  # a concurrent writer of the same key won
                try:  # a symlink or other planted entry: not ours to keep
                    os.unlink(digest, dir_fd=sfd)
                except IsADirectoryError:
                    raise
                except FileNotFoundError:
                    pass
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EMLINK):
                    raise
                # no hard links on this file system: rename (a concurrent same-key put
                # may then be counted twice until the next scan)
                os.replace(tmp, digest, src_dir_fd=sfd, dst_dir_fd=sfd)
                return True
        raise FileExistsError(errno.EEXIST, "cannot replace the entry", self._file(digest))

    def _reserve(self, size: int) -> None:
        """Count ``size`` more bytes in the shared ledger, evicting first if they do not fit.

        The caller's temp file already exists, so a scan counts it: after an eviction the
        recounted total includes this value.
        """
        with self._locked():
            found = self._read_ledger_full()
            if found is not None and found[0] + size <= self.capacity_bytes:
                self._write_ledger(found[0] + size)
                return
            limit = max(self._low_water(), size)
            self._write_ledger(self._evict_locked(limit, 0, trigger=self.capacity_bytes))

    def _relieve_disk(self, size: int, exc: OSError) -> None:
        """ENOSPC: evict at least ``size`` bytes and a tenth of what is stored (so the next
        puts do not hit the wall again at once), at least to the low-water mark."""
        with self._locked():
            before = self.stats["evictions"]
            total = self._scan_total()
            limit = max(0, min(self._low_water(), int(total * LOW_WATER), total - size))
            after = self._evict_locked(limit, 0)
            self._write_ledger(after)
            self.stats["disk_full"] += 1
            evicted = self.stats["evictions"] - before
        self._warn.warning(
            "enospc",
            "local store %s: disk full (%s); evicted %d values (%d bytes), retrying once",
            self.path,
            exc.strerror,
            evicted,
            total - after,
        )

    # -- reads ----------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values per key; None when missing or corrupt (corrupt files are removed)."""
        self._check_open()
        out: list[bytes | None] = []
        try:
            for key in keys:
                out.append(self._get_one(key))
        except StoreError:
            with self._lock:
                self.stats["errors"] += 1
            raise
        return out

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Read each value's payload straight from its file into the buffer of the same
        index (``os.preadv``: no ``bytes`` per value, no staging copy), then verify it
        there. False for a missing or corrupt value or one whose size is not the buffer's."""
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError(f"get_many_into: {len(keys)} keys for {len(buffers)} buffers")
        out: list[bool] = []
        try:
            for key, buf in zip(keys, buffers, strict=True):
                out.append(self._get_one_into(key, as_bytes_view(buf)))
        except StoreError:
            with self._lock:
                self.stats["errors"] += 1
            raise
        return out

    def _open_value(self, digest: str) -> tuple[int, int] | None:
        """(shard descriptor, value descriptor), or None when missing; a symlink in place
        of the value is removed and counted corrupt."""
        shard = digest[:2]
        for _ in range(2):
            sfd = self._shard(shard, create=False)
            if sfd is None:
                return None
            try:
                return sfd, os.open(digest, _READ_FLAGS, dir_fd=sfd)
            except FileNotFoundError:
                if not self._stale_shard(shard, sfd):
                    return None
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise StoreError(
                        f"local store: cannot open {self._file(digest)!r}: {exc}"
                    ) from exc
                self._warn.warning(
                    "symlink", "local store: symlink in place of %s removed", self._file(digest)
                )
                self._unlink_quietly(sfd, digest)
                with self._lock:
                    self.stats["corrupt"] += 1
                return None
        return None

    def _get_one(self, key: str) -> bytes | None:
        got = self._read(key, None)
        return got if type(got) is bytes else None

    def _get_one_into(self, key: str, buf: memoryview) -> bool:
        return self._read(key, buf) is True

    def _read(self, key: str, into: memoryview | None) -> bytes | bool | None:
        """One value: its payload as ``bytes`` (``into`` None), or read straight into
        ``into`` (True when filled); None / False when missing, corrupt or (``into``) of
        another size."""
        kb = key_bytes(key)
        digest = self._digest(kb)
        opened = self._open_value(digest)
        if opened is None:
            self._count_get(hit=False)
            return None
        sfd, fd = opened
        st: os.stat_result | None = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptValue("not a regular file")
            header = _read_exact(fd, HEADER_SIZE)
            length = payload_length(header)
            if st.st_size != HEADER_SIZE + length:
                raise CorruptValue(f"file is {st.st_size} bytes, frame says {HEADER_SIZE + length}")
            payload: bytes | memoryview
            if into is None:
                payload = _read_exact(fd, length)
            elif length != len(into):
                self._count_get(hit=False)  # a value of another size: not this buffer's
                return False
            else:
                _read_into(fd, into, HEADER_SIZE)
                payload = into
            verify(kb, header, payload, self._secret)
            if os.fstat(fd).st_nlink == 0:  # evicted while we read: answer as the disk does
                self._count_get(hit=False)
                return None
            try:
                now = time.time_ns()
                os.utime(fd, ns=(now, now))  # the LRU order lives in the mtimes
            except OSError:
                pass  # best effort: read-only directory or not our file; the read succeeded
        except CorruptValue as exc:
            self._warn.warning(
                "corrupt",
                "local store: dropped corrupt value %r in %s (%s)",
                key,
                self._file(digest),
                exc,
            )
            self._drop_corrupt(sfd, digest, st)
            return None
        except OSError as exc:
            raise StoreError(f"local store: cannot read {self._file(digest)!r}: {exc}") from exc
        finally:
            os.close(fd)
        self._count_get(hit=True, nbytes=length)
        return True if into is not None else payload

    def _drop_corrupt(self, sfd: int, digest: str, st: os.stat_result | None) -> None:
        """Remove a corrupt file unless a writer has already replaced it with a new one."""
        try:
            now = os.stat(digest, dir_fd=sfd, follow_symlinks=False)
            same_file = st is not None and now.st_ino == st.st_ino
        except FileNotFoundError:
            same_file = False
        if same_file and st is not None and self._unlink_quietly(sfd, digest):
            self._release(st.st_size)
        with self._lock:
            self.stats["corrupt"] += 1
            self.stats["gets"] += 1
            self.stats["misses"] += 1

    def _count_get(self, hit: bool, nbytes: int = 0) -> None:
        with self._lock:
            self.stats["gets"] += 1
            if hit:
                self.stats["hits"] += 1
                self.stats["bytes_read"] += nbytes
            else:
                self.stats["misses"] += 1

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence per key, from the directory itself (a regular file under the key)."""
        self._check_open()
        out: list[bool] = []
        for key in keys:
            digest = self._digest(key_bytes(key))
            shard = digest[:2]
            found = False
            for _ in range(2):
                sfd = self._shard(shard, create=False)
                if sfd is None:
                    break
                found = self._is_value(sfd, digest)
                if found or not self._stale_shard(shard, sfd):
                    break
            out.append(found)
        return out

    # -- introspection / lifecycle ---------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes the shared ledger counts for the directory (headers included)."""
        with self._locked():
            found = self._read_ledger_full()
        return found[0] if found is not None else 0

    def __len__(self) -> int:
        """Values in the directory (a scan: for tests and tools, not hot paths)."""
        with self._locked():
            return len(self._scan(reap=False)[0])

    def close(self) -> None:
        """Refuse further operations and release the descriptors. Files stay."""
        with self._fd_lock:
            if self._closed:
                return
            self._closed = True
            fds = [*self._shards.values(), self._root]
            if self._ledger is not None:
                fds.append(self._ledger)
            self._shards.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        """Release the descriptors of a store dropped without :meth:`close`."""
        if hasattr(self, "_ledger") and not self._closed:
            self.close()


__all__ = ["LocalStore"]
