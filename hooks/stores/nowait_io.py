"""Writes to and reads from non-blocking pipes that keep the GIL.

Why: ``os.write``, ``os.read`` and ``select.select`` give the GIL up around their system
call. Beside vLLM's forward, a thread that keeps the GIL, each take back waits up to the
switch interval (``sys.getswitchinterval()``), however short the call was. A dump
thread's request to its cleaner process (:mod:`.publish_channel`) and its wake of it (a
byte on a pipe) are a few microseconds of kernel work on a descriptor that never blocks
(``O_NONBLOCK``): made with the GIL held, through ``ctypes.PyDLL`` (which, unlike
``CDLL``, does not release it), they cost no wait at all. Only waiting for an answer that
has not come yet gives the GIL up (``select``), once.

Every function here is for a descriptor in non-blocking mode: on a blocking one a full
pipe would stall every thread of the process.
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.PyDLL(None, use_errno=True)
_write = _libc.write
_write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
_write.restype = ctypes.c_ssize_t
_read = _libc.read
_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_read.restype = ctypes.c_ssize_t

_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def write_nowait(fd: int, data: bytes) -> int:
    """Write what the pipe takes of ``data`` now: the bytes written (0 when it is full).
    OSError when the descriptor is bad or nobody reads the pipe any more."""
    n = _write(fd, data, len(data))
    if n < 0:
        err = ctypes.get_errno()
        if err in _AGAIN:
            return 0
        raise OSError(err, os.strerror(err))
    return n


def read_nowait(fd: int, buf: ctypes.Array[ctypes.c_char], at: int, n: int) -> int:
    """Read up to ``n`` bytes that are there now into ``buf`` from offset ``at``: the
    bytes read, 0 when none are there yet, -1 at the end of the stream (the writer
    closed). OSError when the descriptor is bad."""
    if at < 0 or n < 0 or at + n > ctypes.sizeof(buf):
        raise ValueError(f"read_nowait: {n} bytes at {at} overrun a buffer of {ctypes.sizeof(buf)}")
    got = _read(fd, ctypes.addressof(buf) + at, n)
    if got < 0:
        err = ctypes.get_errno()
        if err in _AGAIN:
            return 0
        raise OSError(err, os.strerror(err))
    return got if got else -1


__all__ = ["read_nowait", "write_nowait"]
