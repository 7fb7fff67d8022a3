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
