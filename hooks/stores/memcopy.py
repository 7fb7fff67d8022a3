"""Byte copies between buffers that let other threads run while the bytes move.

Why: ``dst[:] = src`` on memoryviews copies with the GIL held. The connector's dump and
load workers copy every byte of every value (staging buffer <-> store segment) and share
the GIL with vLLM's model runner, so their copies ran one at a time and each one stalled
the forward thread for its duration. ``ctypes.memmove`` is a foreign call: ctypes releases
the GIL around it, and XXH3 releases it while hashing, so two workers now copy at once
(docs/CONNECTOR.md#store: the measurement).

Only whole, C-contiguous, writable buffers have an address ctypes can take, and ``bytes``
objects (``c_char_p`` points into them). A source may also be read-only (a
``memoryview`` of ``bytes``, a read-only mapping: :func:`source_address` asks the buffer
protocol); anything else (a strided view) is copied by slice assignment, as before.
"""

from __future__ import annotations

import ctypes

#: Below this a copy is cheaper than taking two addresses and releasing the GIL.
GIL_FREE_MIN = 64 << 10

_memmove = ctypes.memmove
_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def bytes_address(b: bytes) -> int:
    """Where a ``bytes`` object's data starts (``c_char_p`` of bytes points into it)."""
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value or 0


def address(buf: memoryview | bytes) -> int | None:
    """Where ``buf`` starts, when it is a writable contiguous buffer or a ``bytes`` object
    (valid while the caller holds it), else None."""
    if type(buf) is bytes:
        return bytes_address(buf)
    try:
        return _addressof(_from_buffer(buf))
    except (TypeError, ValueError, BufferError):
        return None


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (its layout is part of the stable ABI)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0  # contiguous bytes, read-only allowed


def source_address(buf: memoryview | bytes) -> int | None:
    """Where ``buf`` starts, for reading only: as :func:`address`, and also when it is
    read-only (a ``memoryview`` of ``bytes``: what a put of ``bytes`` values passes, a
    read-only mapping), when contiguous; None otherwise. Valid while the caller holds
    ``buf``: a ``memoryview`` keeps its exporter's buffer in place while it lives."""
    if type(buf) is bytes:
        return bytes_address(buf)
    try:
        return _addressof(_from_buffer(buf))
    except (TypeError, ValueError, BufferError):
        pass
    view = _PyBuffer()
    try:
        _get_buffer(buf, ctypes.byref(view), _PYBUF_SIMPLE)
    except (TypeError, ValueError, BufferError):  # not contiguous, or no buffer
        return None
    try:
        return view.buf or None
    finally:
        _release_buffer(ctypes.byref(view))


def addresses(dst: memoryview, src: memoryview | bytes) -> tuple[int, int] | None:
    """The start addresses of ``dst`` and ``src`` when ``dst`` is a writable contiguous
    buffer and ``src`` a contiguous one (:func:`source_address`; valid while the caller
    holds them), else None: then copy by slicing."""
    try:
        to = _addressof(_from_buffer(dst))
    except (TypeError, ValueError, BufferError):  # read-only or not contiguous
        return None
    src_at = source_address(src)
    return None if src_at is None else (to, src_at)


def move(dst_address: int, src_address: int, n: int) -> None:
    """``n`` bytes from ``src_address`` to ``dst_address`` (from :func:`addresses`; the
    caller checked the bounds), the GIL released meanwhile."""
    _memmove(dst_address, src_address, n)


def copy_bytes(dst: memoryview, src: memoryview | bytes) -> None:
    """``dst[:] = src`` (same length, else ValueError naming both lengths), without the
    GIL when both are writable contiguous buffers of at least :data:`GIL_FREE_MIN` bytes."""
    n = src.nbytes if type(src) is memoryview else len(src)
    if dst.nbytes != n:
        raise ValueError(f"copy_bytes: dst has {dst.nbytes} bytes, src has {n}")
    if n >= GIL_FREE_MIN:
        at = addresses(dst, src)
        if at is not None:
            _memmove(at[0], at[1], n)
            return
    dst[:] = src


__all__ = [
    "GIL_FREE_MIN",
    "address",
    "addresses",
    "bytes_address",
    "copy_bytes",
    "move",
    "source_address",
]
