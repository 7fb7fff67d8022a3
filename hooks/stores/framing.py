"""The integrity frame every store writes in front of a value.

Why: a KV block served with flipped or missing bytes silently corrupts generation, so each
stored value carries a checksum that is verified on every read, by every store. The frame
is the same for the local and the Mooncake store, so one test-suite covers both.

Layout (little-endian, 20 bytes, then the payload)::

    magic  b"UCMv"  4 s   rejects foreign or older-format data
    version         1 B   bumped when the layout changes (old data then reads as corrupt)
    algo            1 B   1 = zlib.crc32
    reserved        2 B   zero
    payload_len     8 B   catches truncation / trailing garbage
    crc32           4 B   over header bytes [0:16] + key (utf-8) + payload

CRC32 (zlib, ~2 GiB/s here and it releases the GIL) is used instead of a cryptographic hash
(blake2b ~0.4 GiB/s): the threat is accidental damage (torn writes, bit rot, a bug writing
the wrong buffer), not an adversary. Binding the key into the checksum also rejects a value
stored or renamed under the wrong key.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"UCMv"
VERSION = 1
ALGO_CRC32 = 1

_HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = _HEADER.size  # 20
_PREFIX = 16  # the header bytes covered by the checksum (everything but the crc itself)


class CorruptValue(ValueError):
    """A stored value failed the frame check; the message says which check."""


def key_bytes(key: str) -> bytes:
    """UTF-8 bytes of a store key; ValueError naming the key when it is not a non-empty str."""
    if type(key) is not str or not key:
        raise ValueError(f"store key must be a non-empty str, got {key!r}")
    return key.encode()


def as_bytes_view(value: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``value`` (no copy).

    Why: callers may hand a memoryview of a typed array (format 'f', several dims); the
    checksum and the copy into staging / files must see raw bytes.
    """
    view = memoryview(value)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def checksum(key: bytes, prefix: bytes | memoryview, payload: bytes | memoryview) -> int:
    """CRC32 over the header prefix, the key and the payload."""
    return zlib.crc32(payload, zlib.crc32(key, zlib.crc32(prefix)))


def make_header(key: bytes, payload: memoryview) -> bytes:
    """The 20-byte frame header for ``payload`` stored under ``key``."""
    prefix = _HEADER.pack(MAGIC, VERSION, ALGO_CRC32, 0, len(payload), 0)[:_PREFIX]
    return prefix + struct.pack("<I", checksum(key, prefix, payload))


def payload_length(header: bytes | memoryview) -> int:
    """Parse a header and return the payload length it announces.

    Raises :class:`CorruptValue` when the magic, version or algorithm is wrong.
    """
    if len(header) < HEADER_SIZE:
        raise CorruptValue(f"header too short: {len(header)} < {HEADER_SIZE} bytes")
    magic, version, algo, _reserved, length, _crc = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if version != VERSION or algo != ALGO_CRC32:
        raise CorruptValue(f"unsupported frame version={version} algo={algo}")
    return length


def verify(key: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> None:
    """Check ``payload`` against ``header`` for ``key``; raise :class:`CorruptValue` if not."""
    length = payload_length(header)
    if length != len(payload):
        raise CorruptValue(f"length mismatch: header says {length}, got {len(payload)} bytes")
    (expected,) = struct.unpack_from("<I", header, _PREFIX)
    actual = checksum(key, header[:_PREFIX], payload)
    if actual != expected:
        raise CorruptValue(f"checksum mismatch: stored {expected:#010x}, computed {actual:#010x}")
