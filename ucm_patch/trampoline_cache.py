"""The compiled code of generated trampolines, kept between processes of this user.

Why: applying the records compiles one small factory per signature shape
(:mod:`ucm_patch.trampoline`), a dozen at vLLM's start, and ``compile`` is about a
quarter of the apply time (docs/BENCHMARKS.md, section 1), while loading the same code
objects back with :mod:`marshal` takes a hundredth of it. So the first start on a
machine compiles, and later ones load, as Python does for modules with ``__pycache__``.

The file is ``$XDG_CACHE_HOME/ucm_patch/trampolines/<interpreter>-<magic>.marshal`` (see
:func:`ucm_patch.environment.user_cache_dir`): one dict, generated source -> module code,
for one bytecode version (the interpreter's cache tag and its ``.pyc`` magic number are in
the name, so a different Python never reads it). Loaded once per process, on the first
compile that is asked for; rewritten whole, through a file of its own and ``os.replace``,
when a shape is added (once at the end of a :func:`batch`: an activation applies a dozen
records), so a reader never sees half a file. Processes that start together
(tensor-parallel ranks) may each write: the last one's file wins and a shape another one
added is compiled again on a later start. Nothing is lost but time.

Never fatal: a cache that cannot be read (missing, damaged, another user's, written by
something else) is ignored, one that cannot be written is not written, and the caller
compiles.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import types

from ucm_patch import environment

# The loaded dict (None until the first lookup); a lock because records may be applied
# from import hooks on any thread.
_lock = threading.Lock()
_codes: dict[str, types.CodeType] | None = None
_batches = 0  # open batch() blocks: writes wait for the last one to close
_unsaved = False


def _after_fork_in_child() -> None:
    # vLLM forks its workers; a fork while another thread held the lock (writing the
    # file) would leave the child's copy locked for ever. The loaded dict stays valid.
    # (A batch another thread had open stays open in the child: it then defers its
    # writes for good, which costs a compile on a later start, nothing else.)
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def path() -> str:
    """The cache file of this interpreter's bytecode version."""
    from importlib.util import MAGIC_NUMBER  # imported by then: the import system uses it

    tag = sys.implementation.cache_tag or sys.implementation.name
    return os.path.join(
        environment.user_cache_dir(), "trampolines", f"{tag}-{MAGIC_NUMBER.hex()}.marshal"
    )


def get(source: str) -> types.CodeType | None:
    """The module code compiled from ``source`` before, or None."""
    with _lock:
        codes = _loaded()
        return codes.get(source)


def put(source: str, code: types.CodeType) -> None:
    """Remember ``code`` as compiled from ``source``, in this process and in the file
    (at once, or when the open :func:`batch` closes)."""
    global _unsaved
    with _lock:
        _loaded()[source] = code
        _unsaved = True
        if _batches == 0:
            _save()


class batch:  # lower case: used like a function, ``with trampoline_cache.batch():``
    """Write the file once, when the block ends, for every :func:`put` inside it.

    A class, not ``contextlib.contextmanager``: ``import ucm_patch`` imports this module,
    and contextlib is not imported by an interpreter started with ``-S``."""

    def __enter__(self) -> None:
        global _batches
        with _lock:
            _batches += 1

    def __exit__(self, *exc: object) -> None:
        global _batches
        with _lock:
            _batches -= 1
            if _batches == 0 and _unsaved:
                _save()


def _save() -> None:
    """Write what this process holds (under ``_lock``)."""
    global _unsaved
    _unsaved = False
    if _codes:
        _write(dict(_codes))


def forget() -> None:
    """Drop what this process loaded (tests: the next lookup reads the file again)."""
    global _codes
    with _lock:
        _codes = None


def _loaded() -> dict[str, types.CodeType]:
    global _codes
    if _codes is None:
        _codes = _read(path())
    return _codes


def _read(file: str) -> dict[str, types.CodeType]:
    import marshal

    try:
        with open(file, "rb") as fh:
            st = os.fstat(fh.fileno())
            # The same rule as the native helpers: only a file of this user's that nobody
            # else can write is run (code objects are code).
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return {}
            data = marshal.loads(fh.read())
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        src: code
        for src, code in data.items()
        if isinstance(src, str) and isinstance(code, types.CodeType)
    }


def _write(codes: dict[str, types.CodeType]) -> None:
    import marshal

    file = path()
    tmp = f"{file}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(file), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(marshal.dumps(codes))
        os.replace(tmp, file)
    except OSError:  # read-only home, full disk: compile next time as well
        try:
            os.unlink(tmp)
        except OSError:
            pass
