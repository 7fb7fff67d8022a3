"""The embedded default store: one file per value in a local directory.

Why files: on one machine, write + rename without fsync matches or beats Mooncake and Redis
(≈1 GiB/s write, 3-5 GiB/s page-cache read, see docs/BENCHMARKS.md), needs no server, and
survives a restart of vLLM, so a new process on the same directory sees the existing values.

Layout: ``<root>/<digest[:2]>/<digest>`` where ``digest`` is a 128-bit blake2b of the key
(keys may hold any characters; 256 shard directories keep directories small). Each file is
an integrity frame (:mod:`ucm_patch.hooks.stores.framing`) followed by the payload.

* Writes go to a hidden temp file in the same shard, then ``os.replace``: a reader sees the
  whole old file, the whole new file or nothing. ``fsync=True`` also syncs the file and the
  shard directory (crash durability at about half the write speed).
* Every read checks the frame (length and CRC32). A mismatch or a truncated file is counted
  in ``stats["corrupt"]``, the file is removed and None is returned: corrupt data is never
  served.
* Capacity: sizes and least-recently-used order live in memory (an ``OrderedDict``) and are
  rebuilt from the directory on start (order from file mtimes; a hit refreshes the mtime so
  the order survives restarts). A put that does not fit evicts the oldest values first; a
  value larger than the whole capacity is skipped (False). The limit is enforced per
  process: several processes sharing one directory each account for what they see.
* Disk errors (full disk ENOSPC, read-only EROFS, permissions EACCES) raise
  :class:`StoreError` from ``put_many``; the temp file is removed, nothing crashes.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.framing import (
    HEADER_SIZE,
    CorruptValue,
    as_bytes_view,
    key_bytes,
    make_header,
    payload_length,
    verify,
)

log = logging.getLogger(__name__)

# A temp file older than this at start-up belongs to a writer that died mid-write.
TMP_GRACE_S = 600.0
_HEX = frozenset("0123456789abcdef")


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


def _is_digest(name: str) -> bool:
    return len(name) == 32 and _HEX.issuperset(name)


def _is_temp(name: str) -> bool:
    """Names written by :meth:`LocalStore._write_file`: ``.<digest>.<pid>.<tid>.<n>.tmp``."""
    return name.startswith(".") and name.endswith(".tmp") and _is_digest(name[1:33])


class LocalStore(KVStore):
    """A directory of checksummed value files with an LRU capacity limit (thread-safe)."""

    name = "local"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, fsync: bool = False):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        self.path = os.path.abspath(os.fspath(path))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> file size, oldest first
        self._used = 0  # bytes of indexed files plus space reserved by writes in flight
        self._closed = False
        self._tmp_seq = itertools.count()
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"local store: cannot create directory {self.path!r}: {exc}") from exc
        self._rebuild()

    # -- start-up -------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the values already in the directory (oldest first); drop stale temp files."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        try:
            shards = [e for e in os.scandir(self.path) if len(e.name) == 2 and e.is_dir()]
        except OSError as exc:
            raise StoreError(f"local store: cannot list {self.path!r}: {exc}") from exc
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError as exc:
                raise StoreError(f"local store: cannot list {shard.path!r}: {exc}") from exc
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile by another process
                if not stat.S_ISREG(st.st_mode):
                    continue
                if _is_digest(entry.name) and entry.name[:2] == shard.name:
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
                elif _is_temp(entry.name) and now - st.st_mtime > TMP_GRACE_S:
                    self._unlink_quietly(entry.path)
        found.sort()
        for _mtime, digest, size in found:
            self._index[digest] = size
            self._used += size
        victims = self._evict_locked(0)  # the capacity may have been lowered since last run
        self._remove_files(victims)

    # -- helpers --------------------------------------------------------------------------

    def _file(self, digest: str) -> str:
        return os.path.join(self.path, digest[:2], digest)

    @staticmethod
    def _digest(kb: bytes) -> str:
        return hashlib.blake2b(kb, digest_size=16).hexdigest()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"local store {self.path!r} is closed")

    def _evict_locked(self, incoming: int) -> list[str]:
        """Pop least-recently-used entries until ``incoming`` more bytes fit (lock held)."""
        victims = []
        while self._index and self._used + incoming > self.capacity_bytes:
            digest, size = self._index.popitem(last=False)
            self._used -= size
            self.stats["evictions"] += 1
            victims.append(digest)
        return victims

    def _remove_files(self, digests: list[str]) -> None:
        """Delete evicted files. Best effort: in a read-only directory eviction must not
        fail reads; the file stays on disk, unindexed (a put there fails on its own)."""
        for digest in digests:
            self._unlink_quietly(self._file(digest))

    @staticmethod
    def _unlink_quietly(path: str) -> None:
        """Best-effort removal of an evicted, temp or corrupt file."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # already gone (another process evicted or replaced it)
        except OSError as exc:  # read-only or permissions: reads never trust such a file
            log.warning("local store: cannot remove %s: %s", path, exc)

    def _adopt(self, digest: str, size: int) -> None:
        """Index a file another process (or an earlier run) wrote, or refresh its LRU slot."""
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
                return
            self._index[digest] = size
            self._used += size
            victims = self._evict_locked(0)
        self._remove_files(victims)

    def _forget(self, digest: str) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._used -= size

    # -- writes ---------------------------------------------------------------------------

    def _write_file(self, digest: str, header: bytes, payload: memoryview) -> None:
        """Write header + payload to a temp file and rename it over the final name."""
        final = self._file(digest)
        shard = os.path.dirname(final)
        tmp = os.path.join(
            shard, f".{digest}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}.tmp"
        )
        try:
            fd = self._open_tmp(tmp, shard)
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(header)
                    f.write(payload)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                self._unlink_quietly(tmp)
                raise
            if self.fsync:
                dir_fd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            raise StoreError(f"local store: cannot write {final!r}: {exc}") from exc

    @staticmethod
    def _open_tmp(tmp: str, shard: str) -> int:
        """Create the temp file exclusively, creating its shard directory on first use."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(shard, exist_ok=True)
            return os.open(tmp, flags, 0o644)

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
            if digest in self._index:
                self._index.move_to_end(digest)
                return True
            if size > self.capacity_bytes:
                self.stats["skipped_full"] += 1
                return False
        try:
            existing = os.stat(self._file(digest)).st_size
        except FileNotFoundError:
            existing = -1
        except OSError as exc:
            raise StoreError(f"local store: cannot stat {self._file(digest)!r}: {exc}") from exc
        if existing >= 0:  # written by another process or before a restart: first value wins
            self._adopt(digest, existing)
            return True
        with self._lock:
            victims = self._evict_locked(size)
            self._used += size  # reserve before writing so concurrent puts cannot overshoot
        try:
            self._remove_files(victims)
            self._write_file(digest, make_header(kb, payload), payload)
        except BaseException:
            with self._lock:
                self._used -= size
            raise
        with self._lock:
            if digest in self._index:  # a concurrent put of the same key won the race
                self._used -= size
            else:
                self._index[digest] = size
                self.stats["bytes_written"] += len(payload)
        return True

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

    def _get_one(self, key: str) -> bytes | None:
        kb = key_bytes(key)
        digest = self._digest(kb)
        path = self._file(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(digest)
            self._count_get(hit=False)
            return None
        except OSError as exc:
            raise StoreError(f"local store: cannot open {path!r}: {exc}") from exc
        try:
            st = os.fstat(fd)
            header = _read_exact(fd, HEADER_SIZE)
            length = payload_length(header)
            if st.st_size != HEADER_SIZE + length:
                raise CorruptValue(f"file is {st.st_size} bytes, frame says {HEADER_SIZE + length}")
            payload = _read_exact(fd, length)
            verify(kb, header, payload)
        except CorruptValue as exc:
            log.warning("local store: dropped corrupt value %r in %s (%s)", key, path, exc)
            self._drop_corrupt(digest, path, st)
            return None
        except OSError as exc:
            raise StoreError(f"local store: cannot read {path!r}: {exc}") from exc
        finally:
            os.close(fd)
        try:
            os.utime(path)  # persist the LRU order for the next start-up
        except OSError:
            pass  # best effort: read-only directory or evicted meanwhile; the read succeeded
        self._adopt(digest, st.st_size)
        self._count_get(hit=True, nbytes=length)
        return payload

    def _drop_corrupt(self, digest: str, path: str, st: os.stat_result) -> None:
        """Remove a corrupt file unless a writer has already replaced it with a new one."""
        try:
            same_file = os.stat(path).st_ino == st.st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            self._unlink_quietly(path)
            self._forget(digest)
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
        """Presence per key (index first, then the directory for other writers' files)."""
        self._check_open()
        out: list[bool] = []
        for key in keys:
            digest = self._digest(key_bytes(key))
            with self._lock:
                known = digest in self._index
            if not known:
                try:
                    size = os.stat(self._file(digest)).st_size
                except FileNotFoundError:
                    out.append(False)
                    continue
                except OSError as exc:
                    err = f"local store: cannot stat {self._file(digest)!r}: {exc}"
                    raise StoreError(err) from exc
                self._adopt(digest, size)
            out.append(True)
        return out

    # -- introspection / lifecycle ---------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the values this process accounts for (headers included)."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def close(self) -> None:
        """Refuse further operations. Files stay; nothing else is held."""
        self._closed = True


__all__ = ["LocalStore"]
