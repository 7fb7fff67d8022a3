"""The memory tiers of this host: who uses each one, whose it is, and removing the ones
nobody can use again.

A memory tier is a directory on a tmpfs, so what it holds is RAM, and it allocates its
whole capacity when it opens (``tier._warm``). One left behind per store directory would
hold that memory for good: a run of three vLLM processes on a temporary store left 2 GiB
in ``/dev/shm``, fifteen minutes of such runs 19 GB. So:

* **Who uses a tier**: every process that has the store open holds a shared ``flock`` on
  the tier's ``tier.json`` (:class:`TierUse`). The kernel drops it when the process ends,
  however it ends (SIGKILL included), so no pid bookkeeping can go stale. Whoever gets the
  lock exclusive (never waiting) knows that no process uses the tier, and keeps every new
  user out while it works: an opener waits on its shared lock, then finds the file it
  locked gone from the tier (or the tier gone) and starts over, making the tier anew.
* **Whose it is**: ``tier.json`` records the disk tier the memory tier spills to: its
  ``local_path``, that directory's device and inode, and the random id the store keeps in
  it (``store.id``: an inode number can be reused by a directory made again). A tier whose
  ``local_path`` is gone, or is another directory now, is an *orphan*
  (:func:`orphan_reason`): nothing can ever read it again.
* **Removed**: by the last process that closes the store, when the tier is not kept
  (``local_memory_keep_bytes`` 0, the default; its values go to the disk tier first:
  ``LocalStore.close``); orphans by the next store that opens on the host (:func:`sweep`
  of the tier base directory) and by ``ucm-patch tiers --remove-orphans``
  (:func:`survey`), which also lists every tier with its size, last use and processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
import time
import weakref
from array import array
from dataclasses import dataclass, field
from typing import Any

from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.ownership import (
    ForeignFile,
    dir_problem,
    open_dir,
    open_file,
    refusal,
)

log = logging.getLogger(__name__)

MARKER = "tier.json"
#: The disk tier's random id (:func:`disk_token`), recorded in the marker.
DISK_TOKEN = "store.id"
#: A tier being removed is renamed to this prefix first (atomic: an opener never finds
#: half of it), then deleted; one left by a process killed meanwhile goes with the sweep.
REMOVING = ".removing-"
#: What a memory tier holds besides its segments (``seg-NNNNN``): removed with it.
_TIER_FILES = ("lru",)
_INDEX_FILES = ("data.mdb", "lock.mdb")
_ATTEMPTS = 16


def tier_base() -> str:
    """The directory of the default memory tiers: ``$XDG_RUNTIME_DIR/ucm_patch`` (a
    per-user tmpfs) when set, else ``/dev/shm/ucm_patch-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "ucm_patch") if runtime else f"/dev/shm/ucm_patch-{os.getuid()}"


# -- the marker ----------------------------------------------------------------------------


def disk_token(dir_fd: int, path: str, file_mode: int) -> str | None:
    """The random id of the disk tier in ``dir_fd`` (``store.id``, made once with
    ``O_EXCL``): what tells a ``local_path`` removed and made again from the one a tier
    belongs to, where a file system reuses the inode number. None where the directory is
    read-only and has none."""
    where = os.path.join(path, DISK_TOKEN)
    try:
        fd, created = open_file(DISK_TOKEN, dir_fd, where, file_mode, create=True)
    except ForeignFile as exc:
        st = os.stat(DISK_TOKEN, dir_fd=dir_fd, follow_symlinks=False)
        raise refusal("disk tier", where, st, exc.strerror, "file") from None
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise StoreError(f"disk tier: cannot open {where!r}: {exc}") from exc
    try:
        if created:
            os.write(fd, secrets.token_hex(16).encode())
        for _ in range(100):  # made by another process this instant: written at once
            token = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            if token:
                return token
            time.sleep(0.001)
        return None
    finally:
        os.close(fd)


def _read_token(path: str) -> str | None:
    """``local_path``'s ``store.id``; "" when it has none; None when it cannot be read."""
    try:
        fd = os.open(os.path.join(path, DISK_TOKEN), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError:
        return None
    try:
        return os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _marker_bytes(local_path: str, disk: os.stat_result, token: str | None, made: bool) -> bytes:
    return json.dumps(
        {
            "local_path": local_path,
            "dev": disk.st_dev,
            "ino": disk.st_ino,
            "token": token,
            "made": made,  # the directory was made for the tier: it goes with it
            "created": time.time(),
        }
    ).encode()


def _read_marker(fd: int) -> dict[str, Any] | None:
    """The marker's record; None when empty (its maker is still writing it) or unreadable."""
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("local_path"), str)
    return data if ok and isinstance(data.get("ino"), int) else None


def orphan_reason(marker: dict[str, Any]) -> str | None:
    """Why the tier of ``marker`` can never be read again (its ``local_path`` is gone, or is
    another directory now); None when it still can, or that cannot be told (no access)."""
    path = marker["local_path"]
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return f"its local_path {path} is gone"
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (marker.get("dev"), marker["ino"]):
        return f"its local_path {path} is another directory now"
    token = marker.get("token")
    if token and _read_token(path) not in (token, None):
        return f"its local_path {path} is another directory now (made again)"
    return None


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _still_there(path: str, dir_fd: int, fd: int, follow: bool) -> bool:
    """Whether the directory at ``path`` is still ``dir_fd`` and its marker still ``fd``
    (a remover renames or unlinks them while it holds the lock exclusive)."""
    try:
        here = os.stat(path, follow_symlinks=follow)
        marker = os.stat(MARKER, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return _same(here, os.fstat(dir_fd)) and _same(marker, os.fstat(fd))


def _remove(path: str, dir_fd: int, in_base: bool, made: bool) -> None:
    """Delete a tier whose marker lock this process holds exclusive. In the tier base it is
    renamed away first (atomic for any opener); elsewhere (``local_memory_path``) only the
    tier's own files go, the marker last, and the directory when it was made for it."""
    if in_base:
        gone = os.path.join(
            os.path.dirname(path),
            f"{REMOVING}{os.path.basename(path)}-{os.getpid()}-{time.monotonic_ns()}",
        )
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
        return
    for name in os.listdir(dir_fd):
        if (name.startswith("seg-") and name[4:].isdigit()) or name in _TIER_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
    with contextlib.suppress(OSError):
        index = os.open("index", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            for name in _INDEX_FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=index)
        finally:
            os.close(index)
        os.rmdir("index", dir_fd=dir_fd)
    os.unlink(MARKER, dir_fd=dir_fd)
    if made:
        with contextlib.suppress(OSError):  # not empty: somebody else's files are there too
            os.rmdir(path)


# -- this process's use of a tier ----------------------------------------------------------

_uses: weakref.WeakSet[TierUse] = weakref.WeakSet()


class TierUse:
    """This process's use of one memory tier: a shared lock on its marker, held from
    :func:`attach` to :meth:`finish` (or the process's end)."""

    def __init__(self, path: str, dir_fd: int, fd: int, in_base: bool, file_mode: int) -> None:
        self.path = path
        self.in_base = in_base
        self._dir_fd = dir_fd
        self._fd: int | None = fd
        self._file_mode = file_mode
        self._pid = os.getpid()
        self._held = [dir_fd, fd]  # closed by finish, or when this is collected
        self._closer = weakref.finalize(self, _close_fds, self._held)
        _uses.add(self)

    def is_last(self) -> bool:
        """Whether no other process (nor another store of this one) uses the tier: then
        the lock is exclusive from now on, and nobody opens the tier until :meth:`finish`.
        When False, this use's shared lock is gone too (``flock`` converts by dropping
        first): call only on the way out."""
        if self._fd is None or self._pid != os.getpid():
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def finish(self, remove: bool = False) -> None:
        """Stop using the tier; with ``remove`` (after :meth:`is_last` said True) delete it."""
        if remove and self._fd is not None and self._pid == os.getpid():
            marker = _read_marker(self._fd) or {}
            try:
                _remove(self.path, self._dir_fd, self.in_base, bool(marker.get("made")))
            except OSError as exc:
                log.warning("memory tier %s: could not be removed: %s", self.path, exc)
        _uses.discard(self)
        self._closer()

    def _after_fork_in_child(self) -> None:
        """A forked child is no user of the tier (a store cannot be used across a fork:
        LMDB refuses the child its environment). Its copy of the lock's descriptor is
        closed at once, so that the child, however long it lives, keeps no lock alive: the
        last user's close still finds itself last, and removes the tier."""
        fd, self._fd = self._fd, None
        if fd is not None:
            self._held.remove(fd)
            with contextlib.suppress(OSError):
                os.close(fd)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _forget_in_child() -> None:
    for use in list(_uses):
        use._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def attach(
    path: str,
    local_path: str,
    disk_fd: int,
    dir_mode: int,
    file_mode: int,
    *,
    in_base: bool,
) -> TierUse:
    """Start using the memory tier at ``path`` for the disk tier ``local_path`` (``disk_fd``:
    its directory), made here when missing: every directory checked (:mod:`.ownership`),
    the tier base first when ``in_base``. A tier found orphaned (its marker names a disk
    tier that is gone or another directory now) is removed and made anew when no process
    uses it. StoreError when a directory or a file is refused."""
    disk = os.fstat(disk_fd)
    token = disk_token(disk_fd, local_path, file_mode)
    if in_base:
        os.close(open_dir(os.path.dirname(path), dir_mode, "memory tier base")[0])
    where = os.path.join(path, MARKER)
    may_remove = True
    for _attempt in range(_ATTEMPTS):
        dir_fd, made = open_dir(path, dir_mode, "memory tier", follow=not in_base)
        try:
            fd, created = open_file(MARKER, dir_fd, where, file_mode, create=True)
        except FileNotFoundError:  # the directory was removed meanwhile
            os.close(dir_fd)
            continue
        except ForeignFile as exc:
            st = os.stat(MARKER, dir_fd=dir_fd, follow_symlinks=False)
            os.close(dir_fd)
            raise refusal("memory tier", where, st, exc.strerror, "file") from None
        except OSError as exc:
            os.close(dir_fd)
            raise StoreError(f"memory tier: cannot open {where!r}: {exc}") from exc
        try:
            if created:
                os.write(fd, _marker_bytes(local_path, disk, token, made or in_base))
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a remover holds it exclusive
            if not _still_there(path, dir_fd, fd, follow=not in_base):
                _close_fds([fd, dir_fd])
                continue
            marker = None if created else _read_marker(fd)
            stale = marker is not None and (
                (marker.get("dev"), marker["ino"]) != (disk.st_dev, disk.st_ino)
                or marker.get("token") != token
            )
            if may_remove and stale and orphan_reason(marker) is not None:  # type: ignore[arg-type]
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # live processes still use it: shared with them as it is
                    may_remove = False
                else:
                    log.info(
                        "memory tier %s: removed (%s; no process used it)",
                        path,
                        orphan_reason(marker),  # type: ignore[arg-type]
                    )
                    _remove(path, dir_fd, in_base, bool(marker.get("made")))  # type: ignore[union-attr]
                _close_fds([fd, dir_fd])
                continue
        except BaseException:
            _close_fds([fd, dir_fd])
            raise
        return TierUse(path, dir_fd, fd, in_base, file_mode)
    raise StoreError(
        f"memory tier {path}: removed and made again by other processes {_ATTEMPTS} times "
        "while this one opened it"
    )


# -- every tier of the host ----------------------------------------------------------------


@dataclass
class TierInfo:
    """One tier of the base directory, as :func:`survey` found it."""

    path: str
    #: ``in use`` (processes hold it), ``idle`` (none does; a store on ``local_path``
    #: reads it warm), ``orphan`` (``reason``: never readable again), ``unowned`` (no
    #: marker: made by an earlier version, or being made), ``foreign`` (not this user's:
    #: never touched).
    state: str
    local_path: str | None = None
    reason: str = ""
    size_bytes: int = 0
    last_use: float | None = None
    pids: list[int] = field(default_factory=list)
    removed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "state": self.state,
            "local_path": self.local_path,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "last_use": self.last_use,
            "pids": self.pids,
            "removed": self.removed,
        }


def tmpfs_bytes(path: str) -> int:
    """Bytes the files under ``path`` take in their file system (allocated blocks, what a
    tmpfs takes from RAM), links not followed."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                if not stat.S_ISDIR(st.st_mode):
                    total += st.st_blocks * 512
    return total


def _last_use(path: str, marker_st: os.stat_result | None) -> float | None:
    """The latest stamp of the tier's ``lru`` (a put or a hit), else its marker's mtime."""
    best = marker_st.st_mtime if marker_st is not None else None
    try:
        with open(os.path.join(path, "lru"), "rb", opener=_nofollow) as f:
            ticks = array("Q")
            ticks.frombytes(f.read())
    except (OSError, ValueError):
        return best
    top = max(ticks, default=0) / 1e9
    return max(top, best or 0.0) if top else best


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def flock_holders(st: os.stat_result) -> list[int]:
    """Pids holding a ``flock`` on the file of ``st`` (``/proc/locks``; [] without it)."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
                    with contextlib.suppress(ValueError):
                        pids.append(int(parts[4]))
    except OSError:
        pass
    return sorted(set(pids))


def mapping_pids(path: str) -> list[int]:
    """Pids that map a file under ``path`` (``/proc/<pid>/maps``): the users of a tier
    made by an earlier version, which took no lock."""
    prefix = os.path.realpath(path) + "/"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as f:
                if any(prefix in line for line in f):
                    pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)


def _examine(path: str, remove_orphans: bool, remove_unowned: bool, details: bool) -> TierInfo:
    """One tier of the base directory; an orphan (or, ``remove_unowned``, a tier without a
    marker nobody maps) removed when asked."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return TierInfo(path, "foreign", reason=f"cannot open: {exc.strerror}")
    try:
        st = os.fstat(dir_fd)
        problem = dir_problem(st, 0o777)  # the base is this user's: anything else is not ours
        if problem is not None:
            return TierInfo(path, "foreign", reason=problem)
        info = TierInfo(path, "unowned", reason="no tier.json: made by an earlier version")
        try:
            fd = os.open(MARKER, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            fd = None
        except OSError as exc:
            return TierInfo(path, "foreign", reason=f"{MARKER}: {exc.strerror}")
        if fd is None:
            if details or remove_unowned:  # a scan of every process: only when asked
                info.pids = mapping_pids(path)
            if info.pids:
                info.state = "in use"
            elif remove_unowned:
                info.size_bytes = tmpfs_bytes(path)
                _remove(path, dir_fd, in_base=True, made=True)
                info.removed = True
                log.info("memory tier %s removed (%d bytes of tmpfs): %s", path,
                         info.size_bytes, info.reason)  # fmt: skip
        else:
            try:
                _examine_marked(info, dir_fd, fd, remove_orphans, details)
            finally:
                os.close(fd)
        if details and not info.removed:
            info.size_bytes = tmpfs_bytes(path)
            try:
                marker_st: os.stat_result | None = os.stat(
                    MARKER, dir_fd=dir_fd, follow_symlinks=False
                )
            except OSError:
                marker_st = None
            info.last_use = _last_use(path, marker_st)
        return info
    finally:
        os.close(dir_fd)


def _examine_marked(
    info: TierInfo, dir_fd: int, fd: int, remove_orphans: bool, details: bool
) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        info.state, info.reason = "foreign", f"{MARKER} is not this user's file"
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        marker = _read_marker(fd)
        info.state, info.reason = "in use", ""
        info.local_path = marker["local_path"] if marker else None
        info.pids = flock_holders(st) if details else []
        return
    marker = _read_marker(fd)
    if marker is None or not _still_there(info.path, dir_fd, fd, follow=False):
        info.state, info.reason = "unowned", "being made or removed"
        return
    info.local_path = marker["local_path"]
    reason = orphan_reason(marker)
    if reason is None:
        info.state, info.reason = "idle", ""
        return
    info.state, info.reason = "orphan", reason
    if remove_orphans:
        info.size_bytes = tmpfs_bytes(info.path)
        _remove(info.path, dir_fd, in_base=True, made=True)
        info.removed = True
        log.info("memory tier %s removed (%d bytes of tmpfs): %s", info.path, info.size_bytes,
                 reason)  # fmt: skip


def survey(
    base: str | None = None,
    *,
    remove_orphans: bool = False,
    remove_unowned: bool = False,
    details: bool = True,
) -> list[TierInfo]:
    """Every tier in the base directory (:func:`tier_base`), with its state, size in the
    tmpfs, last use and processes; orphans removed with ``remove_orphans``, and tiers
    without a marker that no process maps with ``remove_unowned``. Nothing is touched in a
    base directory that is not this user's (nor anything in it that is not)."""
    base = base or tier_base()
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if dir_problem(os.fstat(base_fd), 0o700) is not None:
            return []
        names = sorted(os.listdir(base_fd))
        found = []
        for name in names:
            path = os.path.join(base, name)
            try:
                st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            if name.startswith(REMOVING):
                if st.st_uid == os.geteuid():  # a remover was killed half way
                    shutil.rmtree(path, ignore_errors=True)
                continue
            found.append(_examine(path, remove_orphans, remove_unowned, details))
        return found
    finally:
        os.close(base_fd)


def sweep(base: str | None = None) -> list[TierInfo]:
    """Remove the orphaned tiers of the base directory (:func:`survey`): what a store does
    when it opens. Never raises; a tier in use, idle or without a marker is left alone."""
    try:
        return [t for t in survey(base, remove_orphans=True, details=False) if t.removed]
    except (OSError, StoreError) as exc:
        log.debug("memory tiers: sweep of %s stopped: %s", base or tier_base(), exc)
        return []


__all__ = [
    "MARKER",
    "TierInfo",
    "TierUse",
    "attach",
    "flock_holders",
    "mapping_pids",
    "orphan_reason",
    "survey",
    "sweep",
    "tier_base",
    "tmpfs_bytes",
]
