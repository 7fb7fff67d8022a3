"""The integrity frame's checksum: XXH3 written, CRC32 still read, both reject damage.

issue #18: the checksum sits on every byte of every put and get, so it was chosen by
measurement (hooks/stores/framing.py docstring). Values written by earlier versions
(CRC32 frames) must stay readable.
"""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from ucm_patch.hooks.stores import framing

KEY = b"req-block-0001"


def _crc_frame(key: bytes, payload: bytes) -> bytes:
    """A frame exactly as the CRC32 writer made it (algo 1)."""
    prefix = struct.pack(
        "<4sBBHQ", framing.MAGIC, framing.VERSION, framing.ALGO_CRC32, 0, len(payload)
    )
    crc = zlib.crc32(payload, zlib.crc32(key, zlib.crc32(prefix)))
    return prefix + struct.pack("<I", crc)


def test_new_frames_use_xxh3() -> None:
    payload = memoryview(os.urandom(4096))
    header = framing.make_header(KEY, payload)
    assert header[5] == framing.ALGO_XXH3 == framing.WRITE_ALGO
    framing.verify(KEY, header, payload)


def test_crc32_frames_written_before_stay_readable() -> None:
    payload = os.urandom(4096)
    framing.verify(KEY, _crc_frame(KEY, payload), payload)


def test_streamed_xxh3_frames_written_before_stay_readable() -> None:
    """Algo 3 (XXH3 streamed over prefix, key and payload) was written until the seeded
    one-call checksum (algo 4) replaced it: those values are still served, and damage in
    them is still refused."""
    import xxhash

    payload = bytearray(os.urandom(4096))
    prefix = struct.pack(
        "<4sBBHQ", framing.MAGIC, framing.VERSION, framing.ALGO_XXH3_STREAM, 0, len(payload)
    )
    digest = xxhash.xxh3_64_intdigest(prefix + KEY + bytes(payload)) & 0xFFFFFFFF
    header = prefix + struct.pack("<I", digest)
    framing.verify(KEY, header, payload)
    payload[7] ^= 1
    with pytest.raises(framing.CorruptValue, match="checksum mismatch"):
        framing.verify(KEY, header, payload)


@pytest.mark.parametrize("make", ["xxh3", "crc32"])
def test_both_reject_a_flipped_bit_and_a_wrong_key(make: str) -> None:
    payload = bytearray(os.urandom(4096))
    header = (
        framing.make_header(KEY, memoryview(payload))
        if make == "xxh3"
        else _crc_frame(KEY, bytes(payload))
    )
    with pytest.raises(framing.CorruptValue, match="checksum mismatch"):
        framing.verify(b"req-block-0002", header, payload)
    payload[1234] ^= 0x10
    with pytest.raises(framing.CorruptValue, match="checksum mismatch"):
        framing.verify(KEY, header, payload)


# -- copies checksummed piece by piece (large values) --------------------------------------
SECRET = b"0123456789abcdef-secret"
SIZES = [framing.PIECE - 1, framing.PIECE, framing.PIECE + 1, 2 * framing.PIECE + 4093]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("n", SIZES)
def test_copy_framed_copies_and_frames_as_make_header(n: int, secret: bytes | None) -> None:
    """Hashed in pieces as it is copied, the frame is the one-call frame (a value written
    either way reads either way)."""
    src = memoryview(os.urandom(n))
    dst = memoryview(bytearray(n))
    header = framing.copy_framed(KEY, dst, src, secret)
    assert dst == src
    assert header == framing.make_header(KEY, src, secret)
    back = memoryview(bytearray(n))
    framing.copy_verified(KEY, header, back, dst, secret)
    assert back == src


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unkeyed", "keyed"])
def test_copy_verified_refuses_damage_in_any_piece_naming_the_check(secret: bytes | None) -> None:
    n = 3 * framing.PIECE + 17
    payload = bytearray(os.urandom(n))
    header = framing.make_header(KEY, memoryview(payload), secret)
    message = "authentication failed" if secret else "checksum mismatch"
    for at in (0, framing.PIECE, n - 1):  # the first, a middle and the last piece
        damaged = bytearray(payload)
        damaged[at] ^= 0x01
        with pytest.raises(framing.CorruptValue, match=message):
            framing.copy_verified(
                KEY, header, memoryview(bytearray(n)), memoryview(damaged), secret
            )
    with pytest.raises(framing.CorruptValue, match=message):
        framing.copy_verified(
            b"other-key", header, memoryview(bytearray(n)), memoryview(payload), secret
        )


def test_copy_verified_reads_large_frames_of_earlier_algorithms() -> None:
    payload = os.urandom(2 * framing.PIECE + 5)
    dst = memoryview(bytearray(len(payload)))
    framing.copy_verified(KEY, _crc_frame(KEY, payload), dst, memoryview(payload))
    assert dst == payload


# -- reading into caller buffers (issue #18: no bytes per value on the load path) ----------
def test_local_store_reads_into_buffers_and_checks_them(tmp_path) -> None:
    from ucm_patch.hooks.stores.local import LocalStore

    store = LocalStore(str(tmp_path / "kv"), capacity_bytes=1 << 24)
    a, b = os.urandom(4096), os.urandom(4096)
    assert store.put_many([("a", a), ("b", b), ("small", b"x" * 10)]) == [True] * 3
    out = bytearray(3 * 4096)
    view = memoryview(out)
    bufs = [view[0:4096], view[4096:8192], view[8192:12288]]
    assert store.get_many_into(["a", "b", "missing"], bufs) == [True, True, False]
    assert bytes(view[0:4096]) == a and bytes(view[4096:8192]) == b
    assert store.get_many_into(["small"], [view[:4096]]) == [False]  # another size
    # damage "a" in its segment: rejected in the buffer, then dropped
    at = store.where("a")
    assert at is not None and at.size == 4096
    with open(at.file, "r+b") as f:
        f.seek(at.offset)
        assert f.read(4096) == a
        f.seek(at.offset + 4095)
        f.write(bytes([a[-1] ^ 0xFF]))
    assert store.get_many_into(["a"], [view[0:4096]]) == [False]
    assert store.get_many(["a"]) == [None] and store.stats["corrupt"] == 1
    with pytest.raises(ValueError, match="2 keys for 1 buffers"):
        store.get_many_into(["a", "b"], [view[0:4096]])
    store.close()


@pytest.mark.parametrize("secret", [None, SECRET.decode()], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize("tiers", ["disk", "memory+disk"])
def test_local_store_large_values_round_trip_and_damage_in_a_late_piece_is_refused(
    tmp_path, monkeypatch: pytest.MonkeyPatch, secret: str | None, tiers: str
) -> None:
    """Values of several pieces (:data:`framing.PIECE`), written and read through each
    tier's copy (the memory tier checksums piece by piece as it copies): served whole,
    and one byte damaged in the last piece is refused in the buffer, then dropped."""
    from ucm_patch.hooks.stores.local import LocalStore

    if secret is None:
        monkeypatch.delenv(framing.KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(framing.KEY_ENV, secret)
    monkeypatch.delenv(framing.KEY_FILE_ENV, raising=False)
    memory = {"memory_bytes": 1 << 24, "memory_path": tmp_path / "shm"} if "memory" in tiers else {}
    store = LocalStore(str(tmp_path / "kv"), capacity_bytes=1 << 24, **memory)
    n = 2 * framing.PIECE + 4093
    a, b = os.urandom(n), os.urandom(n)
    assert store.put_many([("a", a), ("b", b)]) == [True, True]
    at = store.where("a")
    assert at is not None and at.size == n and at.tier == tiers.split("+")[0]
    view = memoryview(bytearray(2 * n))
    assert store.get_many_into(["a", "b"], [view[:n], view[n:]]) == [True, True]
    assert view[:n] == a and view[n:] == b
    with open(at.file, "r+b") as f:
        f.seek(at.offset + n - 3)  # in the last piece
        f.write(bytes([a[n - 3] ^ 0x01]))
    assert store.get_many_into(["a"], [view[:n]]) == [False]
    assert store.stats["corrupt"] == 1 and store.get_many(["a"]) == [None]
    store.close()


def test_default_get_many_into_copies_from_get_many() -> None:
    from tests.support.fakes_store import FakeStore

    store = FakeStore()
    store.put_many([("k", b"abcd")])
    buf = memoryview(bytearray(4))
    assert store.get_many_into(["k", "nope"], [buf, memoryview(bytearray(4))]) == [True, False]
    assert bytes(buf) == b"abcd"
