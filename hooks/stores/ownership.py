"""Every directory and file of a local store is this user's: made here, or refused.

Why: the memory tiers live under ``/dev/shm`` (when there is no ``$XDG_RUNTIME_DIR``),
which every local user can write, under names anyone can predict (``ucm_patch-<uid>``, a
hash of ``local_path``). Whoever owns a directory can rename, delete and replace what is
in it, index and segments included: a directory made beforehand by another user would let
them serve forged KV (the checksum does not stop that without ``UCM_PATCH_STORE_KEY``) or
read the KV written there. The same holds for a ``local_path`` in a shared directory.

So, as OpenSSH's ``StrictModes`` does for ``~/.ssh``:

* A directory of a store (the memory tiers' base, each tier, the disk tier, an index) is
  made here with ``dir_mode``, or, when it is there already, it must be a directory owned
  by this user that nobody else may write beyond ``dir_mode``. Otherwise the store refuses
  to open (:class:`StoreError`), naming the path, its owner and its mode. A symbolic link
  is followed only where the user names the directory (``local_path``,
  ``local_memory_path``) and only when the link is this user's or root's; the directories
  the store names itself are opened with ``O_NOFOLLOW``.
* A file is created with ``O_EXCL`` (a file somebody put there first is never taken for
  ours), opened with ``O_NOFOLLOW``, and checked with ``fstat`` once open: a regular file,
  owned by this user, readable or writable by nobody else beyond ``file_mode``.

Nothing is read from or written into a refused directory or file.
"""

from __future__ import annotations

import errno
import os
import stat

from ucm_patch.hooks.stores.base import StoreError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def user_name(uid: int) -> str:
    """``"65534 (nobody)"``: the uid and, where the system knows it, the user's name."""
    try:
        import pwd

        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return str(uid)


def describe(st: os.stat_result) -> str:
    """``owner 65534 (nobody), mode drwxrwxrwx (0777)``."""
    return (
        f"owner {user_name(st.st_uid)}, mode {stat.filemode(st.st_mode)} "
        f"(0{stat.S_IMODE(st.st_mode):03o})"
    )


def dir_problem(st: os.stat_result, dir_mode: int) -> str | None:
    """Why a directory with this ``stat`` is not one a store may use; None when it is."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != me:
        return f"owned by {user_name(st.st_uid)}, not by this user ({user_name(me)})"
    extra = stat.S_IMODE(st.st_mode) & 0o022 & ~dir_mode
    if extra:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if extra & bit)
        return f"writable by {who} beyond local_dir_mode 0{dir_mode:03o}"
    return None


def file_problem(st: os.stat_result, file_mode: int) -> str | None:
    """Why a file with this ``stat`` is not one a store may read or write; None when it is."""
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != me:
        return f"owned by {user_name(st.st_uid)}, not by this user ({user_name(me)})"
    extra = stat.S_IMODE(st.st_mode) & 0o077 & ~file_mode
    if extra:
        return f"open to group/others beyond local_file_mode 0{file_mode:03o}"
    return None


def refusal(what: str, path: str, st: os.stat_result, problem: str, kind: str) -> StoreError:
    """The start-time refusal, worded like OpenSSH's StrictModes ("bad ownership or modes
    for directory ..."), with the path, its owner and its mode."""
    return StoreError(
        f"{what}: bad ownership or modes for {kind} {path}: {describe(st)}: {problem}. A "
        f"local store uses only {kind}s of this user ({user_name(os.geteuid())}) that nobody "
        f"else may write; remove it, or point the store elsewhere"
    )


def open_dir(path: str, dir_mode: int, what: str, *, follow: bool = False) -> tuple[int, bool]:
    """Make the directory ``path`` (its missing parents too, with ``dir_mode``) or check the
    one there: (a descriptor of it, whether it was made here). ``follow``: a symbolic link
    at ``path`` (the user's own or root's) is followed. StoreError when it cannot be made or
    opened, or is refused (:func:`dir_problem`)."""
    made = False
    try:
        os.mkdir(path, dir_mode)
        made = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        try:
            os.makedirs(os.path.dirname(path), mode=dir_mode, exist_ok=True)
            os.mkdir(path, dir_mode)
            made = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"{what}: cannot create directory {path!r}: {exc}") from exc
    except OSError as exc:
        if not os.path.isdir(path):
            raise StoreError(f"{what}: cannot create directory {path!r}: {exc}") from exc
    if follow:
        try:
            link = os.lstat(path)
        except OSError as exc:
            raise StoreError(f"{what}: cannot open directory {path!r}: {exc}") from exc
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.geteuid()):
            raise refusal(what, path, link, "a symbolic link of another user", "directory")
    try:
        fd = os.open(path, _DIR_FLAGS | (0 if follow else os.O_NOFOLLOW))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreError(
                f"{what}: {path!r} is not a directory (a symbolic link is not followed): {exc}"
            ) from exc
        raise StoreError(f"{what}: cannot open directory {path!r}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if made and stat.S_IMODE(st.st_mode) != dir_mode and st.st_uid == os.geteuid():
            os.fchmod(fd, dir_mode)  # the umask may have cut what config asked for
            st = os.fstat(fd)
        problem = dir_problem(st, dir_mode)
        if problem is not None:
            raise refusal(what, path, st, problem, "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd, made


class ForeignFile(OSError):
    """A file of the store's directory that the store does not take for its own: not a
    regular file, another user's, or open to others beyond ``file_mode`` (the message says
    which, with its owner and mode)."""


def check_fd(fd: int, where: str, file_mode: int) -> os.stat_result:
    """``fstat`` of an opened store file; ForeignFile when it is not the store's to use."""
    st = os.fstat(fd)
    problem = file_problem(st, file_mode)
    if problem is not None:
        raise ForeignFile(errno.EPERM, f"{describe(st)}: {problem}", where)
    return st


def open_file(
    name: str, dir_fd: int, where: str, file_mode: int, *, create: bool, flags: int = os.O_RDWR
) -> tuple[int, bool]:
    """Open ``name`` in the directory ``dir_fd`` without following a link, creating it with
    ``O_EXCL`` when it is missing and ``create``: (the descriptor, whether it was created
    here). Checked with ``fstat`` (:func:`check_fd`); a file created here gets ``file_mode``
    whatever the umask. The OSError of ``open`` (FileNotFoundError, ELOOP for a link), or
    ForeignFile."""
    flags |= os.O_CLOEXEC | os.O_NOFOLLOW
    created = False
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, file_mode, dir_fd=dir_fd)
            created = True
        except FileExistsError:  # another process of ours made it meanwhile
            fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if created and stat.S_IMODE(st.st_mode) != file_mode and st.st_uid == os.geteuid():
            os.fchmod(fd, file_mode)  # the umask may have cut what config asked for
        check_fd(fd, where, file_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def check_entries(dir_fd: int, path: str, names: list[str], file_mode: int, what: str) -> None:
    """Refuse at start (:class:`StoreError`) when one of ``names`` in the directory is a
    regular file the store would not take for its own (:func:`file_problem`). Links and
    other kinds are left to the code that opens each file (never followed)."""
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            problem = file_problem(st, file_mode)
            if problem is not None:
                raise refusal(what, os.path.join(path, name), st, problem, "file")


__all__ = [
    "ForeignFile",
    "check_entries",
    "check_fd",
    "describe",
    "dir_problem",
    "file_problem",
    "open_dir",
    "open_file",
    "refusal",
    "user_name",
]
