"""Byte copies between buffers that let other threads run while the bytes move.

Why: ``dst[:] = src`` on memoryviews copies with the GIL held. The connector's dump and
load workers copy every byte of every value (staging buffer <-> store segment) and share
the GIL with vLLM's model runner, so their copies ran one at a time and each one stalled
the forward thread for its duration. ``ctypes.memmove`` is a foreign call: ctypes releases
the GIL around it, and XXH3 releases it while hashing, so two workers now copy at once
(docs/CONNECTOR.md#store: the measurement).

Only whole, C-contiguous, writable buffers have an address ctypes can take, and ``bytes``
objects (``c_char_p`` points into them); anything else (a read-only mapping, a strided
view) is copied by slice assignment, as before.
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


def addresses(dst: memoryview, src: memoryview | bytes) -> tuple[int, int] | None:
    """The start addresses of ``dst`` and ``src`` when ``dst`` is a writable contiguous
    buffer and ``src`` one too or a ``bytes`` object (valid while the caller holds them),
    else None: then copy by slicing."""
    try:
        to = _addressof(_from_buffer(dst))
        if type(src) is bytes:  # immutable: its buffer is only readable, and never moves
            return to, bytes_address(src)
        return to, _addressof(_from_buffer(src))
    except (TypeError, ValueError, BufferError):  # read-only or not contiguous
        return None


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


__all__ = ["GIL_FREE_MIN", "address", "addresses", "bytes_address", "copy_bytes", "move"]
