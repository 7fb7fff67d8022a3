"""hooks/stores/memcopy.py: the copy the stores use for every value's bytes.

A writable contiguous destination and a contiguous source (writable, ``bytes``, or
read-only) go through ``ctypes.memmove`` (a foreign call: ctypes lets other threads run
meanwhile; bench_stores shows what that buys with several workers); anything else is
copied by slicing; a length mismatch is refused before any byte moves.
"""

from __future__ import annotations

import mmap

import pytest

from ucm_patch.hooks.stores import framing, memcopy

N = 1 << 20


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = memcopy._memmove
    monkeypatch.setattr(memcopy, "_memmove", lambda d, s, n: (calls.append(n), real(d, s, n)))
    return calls


def test_writable_buffers_are_moved_without_slicing(moves: list[int]) -> None:
    src = bytearray(range(256)) * (N // 256)
    dst = memoryview(bytearray(N))
    memcopy.copy_bytes(dst, memoryview(src))
    assert dst.tobytes() == bytes(src) and moves == [N]


def test_a_bytes_source_is_moved_without_slicing(moves: list[int]) -> None:
    data = bytes(range(256)) * (N // 256)
    dst = memoryview(bytearray(N))
    memcopy.copy_bytes(dst, data)  # immutable: its address is taken through c_char_p
    assert dst.tobytes() == data and moves == [N]


def test_read_only_sources_move_and_small_ones_are_sliced(moves: list[int]) -> None:
    """A read-only view (a put of ``bytes`` values passes one) has an address for
    reading: one move without the GIL, from the right place of a slice too; a copy below
    GIL_FREE_MIN and a strided source are sliced."""
    data = bytes(range(256)) * (N // 256)
    dst = memoryview(bytearray(N))
    memcopy.copy_bytes(dst, memoryview(data))
    half = memoryview(bytearray(N // 2))
    memcopy.copy_bytes(half, memoryview(data)[N // 2 :])
    small = memoryview(bytearray(memcopy.GIL_FREE_MIN - 1))
    memcopy.copy_bytes(small, memoryview(bytearray(b"x" * len(small))))
    strided = memoryview(bytearray(N // 2))
    memcopy.copy_bytes(strided, memoryview(data)[::2])
    assert dst.tobytes() == data and half.tobytes() == data[N // 2 :]
    assert small.tobytes() == b"x" * len(small) and strided.tobytes() == data[::2]
    assert moves == [N, N // 2]
    assert memcopy.addresses(dst, memoryview(data)[::2]) is None
    assert memcopy.addresses(memoryview(data), memoryview(bytearray(N))) is None  # dst read-only


def test_a_read_only_mapping_moves(moves: list[int], tmp_path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(b"\x07" * N)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), N, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        dst = memoryview(bytearray(N))
        memcopy.copy_bytes(dst, view)
        view.release()
    assert dst.tobytes() == b"\x07" * N and moves == [N]


def test_length_mismatch_is_refused_before_a_byte_moves(moves: list[int]) -> None:
    dst = memoryview(bytearray(N))
    with pytest.raises(ValueError, match=f"dst has {N} bytes, src has {N + 1}"):
        memcopy.copy_bytes(dst, memoryview(bytearray(N + 1)))
    assert moves == [] and dst.tobytes() == bytes(N)


def test_copy_framed_moves_every_piece_and_keeps_the_digest(moves: list[int]) -> None:
    """A value over PIECE: one move per piece, hashed after it; the header equals the
    one-call header of the same bytes (what a reader checks)."""
    n = 3 * framing.PIECE + 123
    src = memoryview(bytearray((i * 7) & 0xFF for i in range(n)))
    dst = memoryview(bytearray(n))
    header = framing.copy_framed(b"key", dst, src)
    assert dst.tobytes() == src.tobytes()
    assert header == framing.make_header(b"key", src)
    assert moves == [framing.PIECE] * 3 + [123]
    framing.verify(b"key", header, dst)
