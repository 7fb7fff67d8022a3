"""The segment files of one tier: fixed-size files that hold many values each, reused.

Why segments: a file per value costs a create, a link and an unlink per value (the old
local store put at a few percent of memcpy, whatever the hardware). A segment is created
once and then rewritten in place for ever: a put is one ``pwritev`` (disk tier) or one
copy into a shared mapping (memory tier) per batch, into pages the kernel already has.

Two ways to reach the bytes, one per tier:

* :class:`FileSegments` (disk tier): ``pwritev`` / ``preadv``. A full disk reports ENOSPC
  on the write, which the tier answers by evicting and retrying.
* :class:`MappedSegments` (memory tier, a tmpfs such as ``/dev/shm``): each segment is
  ``mmap``-ed once per process, so a put and a get are one ``memcpy`` each. A store into a
  hole of a full tmpfs would raise SIGBUS, so every range is ``posix_fallocate``-d before
  it is written (ENOSPC comes back as an error), and every read checks the file's size
  first (a file truncated behind the store reads as corrupt, never as SIGBUS).

Files are opened through the tier directory's descriptor with ``O_NOFOLLOW``: a symlink
planted in place of a segment is never followed (:class:`SegmentLost`). A segment is
created with ``O_EXCL`` and checked with ``fstat`` once open (:mod:`.ownership`): a file
that is not a regular one, another user's, or open to others beyond ``file_mode`` is never
read or written (:class:`SegmentLost`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
from typing import Any

from ucm_patch.hooks.stores.framing import CorruptValue
from ucm_patch.hooks.stores.memcopy import copy_bytes
from ucm_patch.hooks.stores.ownership import ForeignFile, open_file
from ucm_patch.hooks.stores.publish_channel import is_beside_forward
from ucm_patch.hooks.stores.rowcopy import FileState, fstat_held

log = logging.getLogger(__name__)

#: ``sync_file_range(2)``'s "start writeback of the range, do not wait" (Linux; Python's
#: ``os`` has no binding). None where libc lacks it: writeback is then the kernel's own.
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _sync_file_range()


class SegmentLost(OSError):
    """A segment file is missing, or is not a regular file (a planted symlink)."""


def segment_name(seg: int) -> str:
    return f"seg-{seg:05d}"


class FileSegments:
    """Segments read and written with ``preadv`` / ``pwritev`` (the disk tier)."""

    def __init__(self, dir_fd: int, path: str, segment_bytes: int, file_mode: int) -> None:
        self.dir_fd = dir_fd
        self.path = path
        self.segment_bytes = segment_bytes
        self.file_mode = file_mode
        self._fds: dict[int, int] = {}
        # this batch's live_fd
        self._checked: dict[int, tuple[int, FileState | os.stat_result]] = {}
        self._lock = threading.Lock()  # guards _fds; never held across I/O

    def where(self, seg: int) -> str:
        return os.path.join(self.path, segment_name(seg))

    def fd(self, seg: int, create: bool = False) -> int:
        """The segment's descriptor (cached). SegmentLost when it is gone or not a file."""
        fd = self._fds.get(seg)
        if fd is not None:
            return fd
        name, where = segment_name(seg), self.where(seg)
        try:  # created exclusively, checked once open: ours, a regular file (ownership)
            try:
                fd = open_file(name, self.dir_fd, where, self.file_mode, create=create)[0]
            except OSError as exc:
                planted = isinstance(exc, ForeignFile) or exc.errno == errno.ELOOP
                if not create or not planted:
                    raise
                # a symlink, or a file the store would not use, where our segment belongs:
                # its name removed (a writer's own directory), never followed, read or
                # written; a file of our own is made in its place
                log.warning("segment %s: %s: replaced by a new file", where, exc.strerror)
                os.unlink(name, dir_fd=self.dir_fd)
                fd = open_file(name, self.dir_fd, where, self.file_mode, create=True)[0]
        except FileNotFoundError as exc:
            raise SegmentLost(errno.ENOENT, "segment missing", where) from exc
        except ForeignFile as exc:
            raise SegmentLost(errno.EPERM, f"refused: {exc.strerror}", where) from exc
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES) and not create:
                fd = self._open_read_only(seg)  # a read-only directory still serves reads
            elif exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise SegmentLost(exc.errno, "not a regular file", self.where(seg)) from exc
            else:
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentLost(errno.EINVAL, "not a regular file", self.where(seg))
            if create and stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)  # the umask may have cut what config asked for
            extra = self._opened(seg, fd, create)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:  # published whole: a thread that finds the fd finds its mapping
            if seg not in self._fds:
                self._fds[seg] = fd
                self._install(seg, extra)
                return fd
            found = self._fds[seg]  # another thread opened it first
        self._discard(extra)
        os.close(fd)
        return found

    def _open_read_only(self, seg: int) -> int:
        where = self.where(seg)
        try:
            return open_file(
                segment_name(seg), self.dir_fd, where, self.file_mode, create=False,
                flags=os.O_RDONLY,
            )[0]  # fmt: skip
        except ForeignFile as exc:
            raise SegmentLost(errno.EPERM, f"refused: {exc.strerror}", where) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOENT):
                raise SegmentLost(exc.errno, "not a regular file", where) from exc
            raise

    def _opened(self, seg: int, fd: int, create: bool) -> Any:
        """What a subclass keeps per open file (the memory tier: its mapping)."""
        return None

    def _install(self, seg: int, extra: Any) -> None:
        """Keep ``extra`` for ``seg`` (called with the lock held)."""

    def _discard(self, extra: Any) -> None:
        """Drop an ``extra`` that lost the race to another thread's."""

    def live_fd(self, seg: int, create: bool = False) -> tuple[int, FileState | os.stat_result]:
        """The descriptor and its ``fstat``, reopened when the file was deleted behind the
        store since it was opened (a new file of that name may be the segment now).
        Checked once per batch (:meth:`new_batch`), not once per value."""
        hit = self._checked.get(seg)
        if hit is not None:
            return hit
        fd = self.fd(seg, create)
        st = self._fstat(fd)
        if st.st_nlink == 0:
            self.forget(seg)
            fd = self.fd(seg, create)
            st = self._fstat(fd)
        self._checked[seg] = (fd, st)
        return fd, st

    def _fstat(self, fd: int) -> FileState | os.stat_result:
        """A segment file's ``fstat``, for :meth:`live_fd`."""
        return os.fstat(fd)

    def new_batch(self) -> None:
        """Forget which files were checked: the next access to each checks it again."""
        self._checked = {}

    def write(self, seg: int, offset: int, parts: list[bytes | memoryview]) -> None:
        """Write ``parts`` back to back at ``offset`` (as few ``pwritev`` calls as can be)."""
        fd = self.live_fd(seg, create=True)[0]
        bufs = parts
        while bufs:
            n = os.pwritev(fd, bufs[:1024], offset)  # IOV_MAX
            offset += n
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs = bufs[1:]
            if bufs and n:
                bufs = [memoryview(bufs[0])[n:], *bufs[1:]]

    def read_into(self, seg: int, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` back to back from ``offset``; CorruptValue when the file ends first."""
        fd = self.live_fd(seg)[0]
        want = sum(len(b) for b in bufs)
        got = os.preadv(fd, bufs, offset)
        while got < want:  # short read: finish buffer by buffer
            done, rest = got, []
            for b in bufs:
                if done >= len(b):
                    done -= len(b)
                    continue
                rest.append(b[done:])
                done = 0
            k = os.preadv(fd, rest, offset + got)
            if k == 0:
                raise CorruptValue(f"segment ended after {got} of {want} bytes")
            got += k

    def read(self, seg: int, offset: int, n: int) -> bytes:
        data = os.pread(self.live_fd(seg)[0], n, offset)
        if len(data) != n:
            raise CorruptValue(f"segment ended after {len(data)} of {n} bytes")
        return data

    def sync(self, seg: int) -> None:
        os.fdatasync(self.fd(seg))

    def start_writeback(self, seg: int, offset: int, n: int) -> None:
        """Start writing ``n`` bytes at ``offset`` back to the device now, from this
        thread, without waiting for it (best effort). Why: left to the kernel, dirty pages
        are written back by its flusher threads, at normal CPU priority, on whichever core
        they wake; beside a full store's writers, those threads are what preempt a put for
        several milliseconds (measured: bench_stores, "two tiers", slowest call). Started
        here, by the cleaner process at low priority (:mod:`.cleaner_process`), the work is
        that process's, and a device slower than the spills throttles the spills, not the
        puts (their reserve runs dry and they skip, never wait)."""
        if _START_WRITEBACK is not None:
            _START_WRITEBACK(self.fd(seg), offset, n, SYNC_FILE_RANGE_WRITE)

    def mapping(self, seg: int, end: int, write: bool = False) -> memoryview | None:
        """The segment's bytes in this process's memory, valid up to ``end`` (None: this
        kind of segment is reached with system calls only)."""
        return None

    def cut(self, seg: int, end: int) -> None:
        """Drop the file's bytes after ``end`` (a failed write's), best effort."""
        try:
            fd = self.live_fd(seg)[0]
            if os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
        except OSError:
            pass
        self._checked.pop(seg, None)

    def forget(self, seg: int) -> None:
        """Close this process's handle of ``seg`` (the file was replaced or removed)."""
        with self._lock:
            fd = self._fds.pop(seg, None)
            self._checked.pop(seg, None)
        if fd is not None:
            self._closed(seg)
            os.close(fd)

    def _closed(self, seg: int) -> None:
        """Hook for subclasses (the memory tier unmaps the file)."""

    def remove(self, seg: int) -> int:
        """Delete the segment's file (its space goes back to the file system): bytes freed."""
        self.forget(seg)
        try:
            st = os.stat(segment_name(seg), dir_fd=self.dir_fd, follow_symlinks=False)
            os.unlink(segment_name(seg), dir_fd=self.dir_fd)
        except FileNotFoundError:
            return 0
        return st.st_blocks * 512

    def close(self) -> None:
        with self._lock:
            segs = list(self._fds)
        for seg in segs:
            self.forget(seg)


class MappedSegments(FileSegments):
    """Segments mapped into the process (the memory tier on a tmpfs): one copy per value."""

    def __init__(self, dir_fd: int, path: str, segment_bytes: int, file_mode: int) -> None:
        super().__init__(dir_fd, path, segment_bytes, file_mode)
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._seen: dict[int, tuple[memoryview, int]] = {}  # this batch: view, size checked

    def new_batch(self) -> None:
        super().new_batch()
        self._seen = {}

    def _fstat(self, fd: int) -> FileState | os.stat_result:
        # A tmpfs file's fstat never waits for a device: made with the GIL kept, it costs
        # a dump thread beside the forward no take back (rowcopy.fstat_held); elsewhere
        # (the cleaner process, a put from the main thread) as it always was.
        return fstat_held(fd) if is_beside_forward() else os.fstat(fd)

    def _opened(self, seg: int, fd: int, create: bool) -> tuple[mmap.mmap, memoryview]:
        writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        if create and writable and os.fstat(fd).st_blocks * 512 < self.segment_bytes:
            # every page of the segment now, once per file: ENOSPC here, never a SIGBUS
            # when a copy into the mapping would have had to allocate one
            os.posix_fallocate(fd, 0, self.segment_bytes)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE: the page tables are filled now, not by a fault per page in a copy
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            m = mmap.mmap(fd, self.segment_bytes, flags=flags, prot=prot)
        except ValueError as exc:  # cut short behind the store since its size was checked
            raise SegmentLost(
                errno.EINVAL, f"shorter than a segment ({exc})", self.where(seg)
            ) from exc
        return m, memoryview(m)

    def _install(self, seg: int, extra: tuple[mmap.mmap, memoryview]) -> None:
        self._maps[seg] = extra

    def _discard(self, extra: tuple[mmap.mmap, memoryview]) -> None:
        extra[1].release()
        extra[0].close()

    def _closed(self, seg: int) -> None:
        with self._lock:
            found = self._maps.pop(seg, None)
        if found is not None:
            m, view = found
            view.release()
            try:
                m.close()
            except BufferError:
                pass  # a reader still holds a slice; the mapping goes with it

    def _view(self, seg: int, end: int, create: bool = False) -> memoryview:
        """The segment's mapping, once its file is known to reach ``end``: a file truncated
        behind the store would raise SIGBUS where the copy reads past its end."""
        seen = self._seen.get(seg)
        if seen is not None and seen[1] >= end:  # checked in this batch: no call per value
            return seen[0]
        fd, st = self.live_fd(seg, create)
        if st.st_size < end:  # grown since it was checked (a write), or truncated
            st = self._fstat(fd)
            self._checked[seg] = (fd, st)
            if st.st_size < end:
                raise CorruptValue(f"segment file is shorter than {end} bytes")
        found = self._maps.get(seg)
        if found is None:  # forgotten by another thread meanwhile (its file was replaced)
            raise SegmentLost(errno.ENOENT, "segment reopened meanwhile", self.where(seg))
        self._seen[seg] = (found[1], st.st_size)
        return found[1]

    def mapping(self, seg: int, end: int, write: bool = False) -> memoryview:
        if write:
            fd, st = self.live_fd(seg, create=True)
            if st.st_size < end:  # truncated behind the store: allocated in full again
                os.posix_fallocate(fd, 0, self.segment_bytes)
                self._checked.pop(seg, None)
        return self._view(seg, end, create=write)  # allocated in full when opened

    def write(self, seg: int, offset: int, parts: list[bytes | memoryview]) -> None:
        end = offset + sum(len(p) for p in parts)
        view = self.mapping(seg, end, write=True)
        for p in parts:
            n = len(p)
            copy_bytes(view[offset : offset + n], p)
            offset += n

    def read_into(self, seg: int, offset: int, bufs: list[memoryview]) -> None:
        end = offset + sum(len(b) for b in bufs)
        view = self._view(seg, end)
        for b in bufs:
            n = len(b)
            copy_bytes(b, view[offset : offset + n])
            offset += n

    def read(self, seg: int, offset: int, n: int) -> bytes:
        return bytes(self._view(seg, offset + n)[offset : offset + n])

    def sync(self, seg: int) -> None:
        """Memory has nothing to sync to."""

    def start_writeback(self, seg: int, offset: int, n: int) -> None:
        """Memory has nothing to write back."""

    def cut(self, seg: int, end: int) -> None:
        """A mapped segment keeps its pages (they were allocated in full when it was
        created; a copy into it does not fail half way)."""


__all__ = ["FileSegments", "MappedSegments", "SegmentLost", "segment_name"]
