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


def test_default_get_many_into_copies_from_get_many() -> None:
    from tests.support.fakes_store import FakeStore

    store = FakeStore()
    store.put_many([("k", b"abcd")])
    buf = memoryview(bytearray(4))
    assert store.get_many_into(["k", "nope"], [buf, memoryview(bytearray(4))]) == [True, False]
    assert bytes(buf) == b"abcd"
