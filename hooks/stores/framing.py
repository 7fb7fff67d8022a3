"""The integrity frame every store writes in front of a value.

Why: a KV block served with flipped or missing bytes silently corrupts generation, so each
stored value carries a checksum that is verified on every read, by every store. The frame
is the same for the local and the Mooncake store, so one test-suite covers both.

Layout (little-endian, 20 bytes, then the payload)::

    magic  b"UCMv"  4 s   rejects foreign or older-format data
    version         1 B   bumped when the layout changes (old data then reads as corrupt)
    algo            1 B   4 = seeded XXH3-64 (written); 3 = XXH3-64 and 1 = zlib.crc32
                          (written by earlier versions, still read)
    reserved        2 B   zero
    payload_len     8 B   catches truncation / trailing garbage
    checksum        4 B   over header bytes [0:16] + key (utf-8) + payload, low 32 bits:
                          algo 4: XXH3-64 of the payload seeded with the XXH3-64 of
                          header bytes [0:16] + key (one pass, one call per value);
                          algo 3: XXH3-64 streamed over all three; algo 1: CRC32

Keyed frame (algo 2), used when a store key is set (``UCM_PATCH_STORE_KEY`` or
``UCM_PATCH_STORE_KEY_FILE``; environment only, never store config, so the secret does not
end up in vLLM's logged config). Same 20 bytes, so buffer arithmetic does not change::

    magic  b"UCMv"  4 s
    version         1 B
    algo            1 B   2 = keyed blake2b
    payload_len     6 B   up to 256 TiB
    mac             8 B   blake2b(key=secret, digest_size=8) over header bytes [0:12] +
                          key (utf-8) + payload

Why: a CRC detects accidents but anyone who can write the directory (or a Mooncake segment)
can forge one. With a key set, a CRC-only value or one made with another key is rejected
like a corrupt value, so a writer without the key cannot get a value served. A 64-bit tag
suffices because a forger cannot test guesses offline: each try costs a served read.

Without a key, a fast non-cryptographic checksum is used: the threat is accidental damage
(torn writes, bit rot, a bug writing the wrong buffer), not an adversary. Binding the key
into the checksum also rejects a value stored or renamed under the wrong key. Which one
was chosen by measurement (``scripts/bench_stores.py`` prints the XXH3 rate next to memcpy;
docs/BENCHMARKS.md): XXH3-64 (``xxhash``) runs several times faster than ``zlib.crc32``
and faster than hardware CRC32C, and the checksum runs over every byte of every put and
get. Algo 4 hashes the payload in one call seeded by the key's hash, so a put costs one
C call per value beyond its copy (a value over :data:`PIECE`: one per piece, each hashed
right after its copy, see :func:`copy_framed`; the digest is the same); algo 3 and CRC32
values written before stay readable, and without the ``xxhash`` package the store writes
CRC32 (never fails). 32 bits of XXH3 miss a random corruption with the same 2^-32 chance as
a CRC32. python-xxhash releases the GIL while hashing (since 3.0, the oldest version this
package accepts), as zlib does, so other threads run meanwhile: the disk tier writes a
batch's payloads while it hashes them (:mod:`.sidecar`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add
from typing import Any

from ucm_patch import environment
from ucm_patch.hooks.stores import rowcopy
from ucm_patch.hooks.stores.memcopy import (
    addresses,
    bytes_address,
    copy_bytes,
    move,
    source_address,
)
from ucm_patch.hooks.stores.scatter import Scatter, scatter_from

try:  # XXH3 (module docstring); CRC32 without the package
    from xxhash import xxh3_64 as _xxh3_64
    from xxhash import xxh3_64_intdigest as _xxh3_64_int
except ImportError:  # pragma: no cover - xxhash is an install requirement
    _xxh3_64 = _xxh3_64_int = None

MAGIC = b"UCMv"
VERSION = 1
ALGO_CRC32 = 1
ALGO_KEYED = 2
ALGO_XXH3_STREAM = 3  # streamed over prefix, key and payload: written before algo 4
ALGO_XXH3 = 4  # the payload's XXH3 seeded with the XXH3 of prefix and key
_READ_ALGOS = (ALGO_CRC32, ALGO_XXH3_STREAM, ALGO_XXH3)
#: The algorithm new unkeyed frames use.
WRITE_ALGO = ALGO_CRC32 if _xxh3_64 is None else ALGO_XXH3
#: The key's variables (declared, read and parsed by :mod:`ucm_patch.environment`).
KEY_ENV = environment.STORE_KEY
KEY_FILE_ENV = environment.STORE_KEY_FILE
MIN_KEY_BYTES = 16

_HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = _HEADER.size  # 20
_PREFIX = 16  # the header bytes covered by the checksum (everything but the crc itself)
_U32 = struct.Struct("<I")
_LOW32 = 0xFFFFFFFF
_prefixes: dict[int, bytes] = {}  # payload length -> unkeyed header prefix (the first 64)
_KEYED = struct.Struct("<4sBB6s8s")
_KEYED_PREFIX = 12  # magic, version, algo, payload_len: what the mac covers of the header
_PERSON = b"ucm_patch.kv.v1"  # blake2b personalisation: tags are useless in other contexts
#: Payloads longer than this are copied and checksummed in pieces of this size
#: (:func:`copy_framed`): a checksum over a whole 2 MiB copy reads it from memory again,
#: while a 256 KiB piece hashed right after its copy is still in the cache.
PIECE = 256 << 10


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


def checksum(
    key: bytes, prefix: bytes | memoryview, payload: bytes | memoryview, algo: int = ALGO_CRC32
) -> int:
    """The 32-bit checksum of ``algo`` over the header prefix, the key and the payload."""
    if algo == ALGO_XXH3:
        if _xxh3_64_int is None:
            raise CorruptValue("XXH3 frame but the xxhash package is not installed")
        return _xxh3_64_int(payload, _xxh3_64_int(bytes(prefix) + key)) & _LOW32
    if algo == ALGO_XXH3_STREAM:
        if _xxh3_64 is None:
            raise CorruptValue("XXH3 frame but the xxhash package is not installed")
        h = _xxh3_64(prefix)
        h.update(key)
        h.update(payload)
        return h.intdigest() & _LOW32
    return zlib.crc32(payload, zlib.crc32(key, zlib.crc32(prefix)))


def load_store_key(env: dict[str, str] | None = None) -> bytes | None:
    """The integrity key from the environment (``env``: a mapping to read instead, tests),
    or None when neither variable is set.

    Why a ValueError (naming the variable) for a short key, an unreadable file, or both
    variables set: silently running without the key the operator meant to set would
    serve unauthenticated values.
    """
    source = environment.read(env).store_key_source()
    if source is None:
        return None
    if source[0] == KEY_ENV:
        secret, where = source[1].encode(), KEY_ENV
    else:
        path = source[1]
        where = f"{KEY_FILE_ENV}={path!r}"
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the key file: {exc}") from exc
        if stat.S_IMODE(mode) & 0o077:
            logging.getLogger(__name__).warning(
                "%s: key file is readable by group/others (mode %o); use chmod 600",
                where,
                stat.S_IMODE(mode),
            )
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: the key must be at least {MIN_KEY_BYTES} bytes")
    if len(secret) > 64:  # blake2b takes at most 64 key bytes; longer keys are hashed first
        secret = hashlib.blake2b(secret).digest()
    return secret


def _mac(
    secret: bytes, key: bytes, prefix: bytes | memoryview, payload: bytes | memoryview
) -> bytes:
    """The 8-byte keyed tag over the header prefix, the key and the payload."""
    h = hashlib.blake2b(prefix, digest_size=8, key=secret, person=_PERSON)
    h.update(key)
    h.update(payload)
    return h.digest()


def _unkeyed_prefix(n: int) -> bytes:
    """The checksummed 16 header bytes of an unkeyed frame of ``n`` payload bytes, kept
    for the first 64 sizes seen (a store sees a few)."""
    prefix = _HEADER.pack(MAGIC, VERSION, WRITE_ALGO, 0, n, 0)[:_PREFIX]
    if len(_prefixes) < 64:
        _prefixes[n] = prefix
    return prefix


def _keyed_prefix(n: int) -> bytes:
    """The authenticated 12 header bytes of a keyed frame of ``n`` payload bytes."""
    return _KEYED.pack(MAGIC, VERSION, ALGO_KEYED, n.to_bytes(6, "little"), b"")[:_KEYED_PREFIX]


def make_header(key: bytes, payload: memoryview, secret: bytes | None = None) -> bytes:
    """The 20-byte frame header for ``payload`` stored under ``key`` (keyed if ``secret``)."""
    if secret is not None:
        prefix = _keyed_prefix(len(payload))
        return prefix + _mac(secret, key, prefix, payload)
    prefix = _prefixes.get(len(payload)) or _unkeyed_prefix(len(payload))
    if _xxh3_64_int is not None:  # algo 4, inlined: a put calls this once per value
        return prefix + _U32.pack(_xxh3_64_int(payload, _xxh3_64_int(prefix + key)) & _LOW32)
    return prefix + _U32.pack(checksum(key, prefix, payload, WRITE_ALGO))


def copy_framed(key: bytes, dst: memoryview, src: memoryview, secret: bytes | None = None) -> bytes:
    """Copy ``src`` into ``dst`` (as long) and return the frame header of the copy.

    A payload longer than :data:`PIECE` is copied and checksummed piece by piece, each
    piece hashed right after its copy, while it is still in the CPU cache; the streamed
    digest is the one-call digest, so the header is :func:`make_header`'s."""
    n = len(src)
    if n <= PIECE:
        copy_bytes(dst, src)
        return make_header(key, dst, secret)
    if secret is not None:
        prefix = _keyed_prefix(n)
        mac = hashlib.blake2b(prefix, digest_size=8, key=secret, person=_PERSON)
        mac.update(key)
        _copy_hashing(dst, src, mac.update)
        return prefix + mac.digest()
    prefix = _prefixes.get(n) or _unkeyed_prefix(n)
    if _xxh3_64 is None:
        copy_bytes(dst, src)
        return make_header(key, dst)
    h = _xxh3_64(seed=_xxh3_64_int(prefix + key))
    _copy_hashing(dst, src, h.update)
    return prefix + _U32.pack(h.intdigest() & _LOW32)


def copy_framed_many(
    entries: Sequence[tuple[bytes, memoryview, memoryview | bytes]], secret: bytes | None = None
) -> list[bytes] | None:
    """:func:`copy_framed` of each (key, dst, src), in one call for all of them
    (:func:`.rowcopy.frame_many`: the GIL given up once per batch, not once per value and
    piece): their frame headers. None where that cannot be (a keyed store, no XXH3, no
    helper, a buffer without an address): the caller frames value by value."""
    if secret is not None or _xxh3_64_int is None:
        return None
    prefixes = [_prefixes.get(len(src)) or _unkeyed_prefix(len(src)) for _k, _d, src in entries]
    items = [(dst, src, prefix + key) for (key, dst, src), prefix in zip(entries, prefixes,
                                                                        strict=True)]  # fmt: skip
    digests = rowcopy.frame_many(items)
    if digests is None:
        return None
    return [p + _U32.pack(d & _LOW32) for p, d in zip(prefixes, digests, strict=True)]


@dataclass(frozen=True, slots=True)
class SendPlan:
    """A put's records placed for :func:`copy_framed_send`: record ``i`` is ``keys[i]``
    with ``payloads[i]``, copied to the address ``dst_at[i]``, its record header right
    before it (``leads[i]``, then the frame header). Every address lies inside a mapping
    in ``held``, and whoever placed the records checked that each ends inside it."""

    keys: list[bytes]
    payloads: list[memoryview | bytes]
    leads: list[bytes]
    dst_at: array[int]
    held: list[memoryview]

    def __len__(self) -> int:
        """The records."""
        return len(self.keys)


def copy_framed_send(
    plan: SendPlan, request: bytes, request_fd: int, answer_fd: int, timeout_s: float,
    secret: bytes | None = None,
) -> tuple[bool, bool] | None:  # fmt: skip
    """Each record of ``plan`` copied into place and framed, its record header (its lead,
    the frame header) written before it; then ``request`` sent on ``request_fd`` and
    ``answer_fd`` waited on, all in one call (:func:`.rowcopy.frame_send`): (the request
    written whole, its answer readable). None where that cannot be (as
    :func:`copy_framed_many`): nothing done.

    The helper's columns are built from integers: each seed material and each header's
    bytes joined into one ``bytes`` and addressed by offset, a destination by the address
    the tier computed, so that only a payload's own address is asked per value (this runs
    with the GIL held, on a dump thread beside the forward)."""
    if secret is not None or _xxh3_64_int is None:
        return None
    payloads = plan.payloads
    n = len(payloads)
    if not n or not len(plan.keys) == len(plan.leads) == len(plan.dst_at) == n:
        raise ValueError(f"copy_framed_send: {len(plan.keys)} keys, {n} payloads, "
                         f"{len(plan.leads)} leads, {len(plan.dst_at)} places")  # fmt: skip
    src = [source_address(p) for p in payloads]
    if None in src:
        return None
    word = rowcopy.WORD
    size = array(word, map(len, payloads))
    prefixes = [_prefixes.get(k) or _unkeyed_prefix(k) for k in size]
    seeds = list(map(add, prefixes, plan.keys))
    seed_len = array(word, map(len, seeds))
    seed_blob = b"".join(seeds)  # held until the call returns: the columns point into it
    seed_src = array(word, accumulate(seed_len, initial=bytes_address(seed_blob)))
    seed_src.pop()
    heads = b"".join(map(add, plan.leads, prefixes))
    head_len = len(plan.leads[0]) + len(prefixes[0])
    if len(heads) != n * head_len:
        raise ValueError(f"copy_framed_send: leads of several lengths ({len(heads)} bytes "
                         f"for {n} of {head_len})")  # fmt: skip
    at = bytes_address(heads)
    head_src = array(word, range(at, at + n * head_len, head_len))
    back = head_len + 4
    head_dst = array(word, [d - back for d in plan.dst_at])
    cols = rowcopy.SendColumns(plan.dst_at, array(word, src), size, seed_src, seed_len,
                               head_dst, head_src)  # fmt: skip
    got = rowcopy.frame_send(cols, head_len, request_fd, request, answer_fd, timeout_s)
    if got is None:
        return None
    code, _digests, _err = got
    return code != rowcopy.SEND_CUT, code == rowcopy.SEND_ANSWERED


def write_framed_many(
    fd: int, entries: Sequence[tuple[bytes, bytes, int, memoryview | bytes]],
    secret: bytes | None = None, beside: bool = False,
) -> bool:  # fmt: skip
    """For each (key, lead, at, payload): the bytes ``lead``, the payload's frame header
    and the payload, written into the file ``fd`` from ``at`` on, every value in one call
    (:func:`.rowcopy.frame_write_many`: the payload hashed and written piece by piece,
    the GIL given up once; ``beside``: hashed on the process's checksum helper thread
    meanwhile). False where that cannot be (as :func:`copy_framed_many`): nothing
    written, the caller writes the usual way. An ``OSError`` of a write is raised."""
    if secret is not None or _xxh3_64_int is None:
        return False
    items = []
    for key, lead, at, payload in entries:
        prefix = _prefixes.get(len(payload)) or _unkeyed_prefix(len(payload))
        header = bytearray(lead + prefix + bytes(4))
        items.append((at + len(header), payload, prefix + key, header, len(header) - 4, at))
    return rowcopy.frame_write_many(fd, items, beside) is not None


def copy_verified(
    key: bytes,
    header: bytes | memoryview,
    dst: memoryview,
    src: memoryview,
    secret: bytes | None = None,
) -> None:
    """Copy ``src`` into ``dst`` (as long) and :func:`verify` the copy against ``header``:
    what a read into a caller's buffer does. Pieces as in :func:`copy_framed` for a value
    this version writes; anything else is copied whole and takes :func:`verify`'s path."""
    n = len(src)
    if (
        n > PIECE
        and secret is None
        and _xxh3_64 is not None
        and header[:_PREFIX] == (_prefixes.get(n) or _unkeyed_prefix(n))
    ):
        h = _xxh3_64(seed=_xxh3_64_int(bytes(header[:_PREFIX]) + key))
        _copy_hashing(dst, src, h.update)
        if _U32.unpack_from(header, _PREFIX)[0] == h.intdigest() & _LOW32:
            return
    else:
        copy_bytes(dst, src)
    verify(key, header, dst, secret)  # raises, naming the check that failed


def copy_verified_many(
    entries: Sequence[tuple[bytes, bytes | memoryview, memoryview, memoryview]],
    secret: bytes | None = None,
) -> list[CorruptValue | None]:
    """:func:`copy_verified` of each (key, header, dst, src): None per value copied and
    verified, its :class:`CorruptValue` otherwise. The values this version writes
    unkeyed are copied and checked in one call for all of them (:mod:`.rowcopy`: the
    GIL given up once, not twice per piece); the others, or all of them where that
    helper is unavailable, one by one."""
    out: list[CorruptValue | None] = [None] * len(entries)
    batch: list[rowcopy.Item] = []
    where: list[int] = []
    if secret is None and _xxh3_64_int is not None:
        for i, (key, header, dst, src) in enumerate(entries):
            n = len(src)
            if len(dst) == n and header[:_PREFIX] == (_prefixes.get(n) or _unkeyed_prefix(n)):
                # the seed's own hash is done in the same call (an XXH3 here would give
                # the GIL up once per value again)
                seed = bytes(header[:_PREFIX]) + key
                batch.append((dst, src, seed, _U32.unpack_from(header, _PREFIX)[0]))
                where.append(i)
    checked = rowcopy.copy_verify_many(batch) if batch else None
    if checked is None:
        where = []
    for i, ok in zip(where, checked or (), strict=True):
        if not ok:  # the precise reason, from the copy
            key, header, dst, _src = entries[i]
            try:
                verify(key, header, dst, secret)
            except CorruptValue as exc:
                out[i] = exc
    done = set(where)
    for i, (key, header, dst, src) in enumerate(entries):
        if i not in done:
            try:
                copy_verified(key, header, dst, src, secret)
            except CorruptValue as exc:
                out[i] = exc
    return out


def scatter_verified_many(
    entries: Sequence[tuple[bytes, bytes | memoryview, memoryview, Scatter]],
    secret: bytes | None = None,
    marks: rowcopy.Marks = (),
    flags: Any = None,
) -> list[CorruptValue | None]:
    """For each (key, header, src, target): ``src``'s pages written where ``target`` says
    (:mod:`.scatter`) and ``src`` verified against ``header``: None per value written and
    verified, its :class:`CorruptValue` otherwise (its pages may have been written: they
    hold nothing usable). The values this version writes unkeyed, all in one call
    (:func:`.rowcopy.scatter_verify_many`: hashed from ``src`` page by page beside the
    copies); otherwise, or where that helper is unavailable, each verified first, then
    written run by run (:func:`.scatter.scatter_from`). ``marks`` into ``flags``: set as
    the values before each mark's end are done (:data:`.rowcopy.Marks`), all by the end."""
    out: list[CorruptValue | None] = [None] * len(entries)
    batch: list[rowcopy.ScatterItem] = []
    if secret is None and _xxh3_64_int is not None:
        for key, header, src, target in entries:
            n = len(src)
            prefix = _prefixes.get(n) or _unkeyed_prefix(n)
            if n != target.nbytes or header[:_PREFIX] != prefix:
                break  # not a frame of this version: every value its own way
            # the seed hashed here (a few dozen bytes: xxhash keeps the GIL for them), so
            # that the helper gets an int, not the address of a bytes object to hash
            seed = _xxh3_64_int(prefix + key)
            batch.append((src, seed, _U32.unpack_from(header, _PREFIX)[0], target))
    whole = bool(batch) and len(batch) == len(entries)
    checked = rowcopy.scatter_verify_many(batch, marks, flags) if whole else None
    if checked is not None:
        for i, ok in enumerate(checked):
            if not ok:  # the precise reason
                key, header, src, _target = entries[i]
                try:
                    verify(key, header, src, secret)
                except CorruptValue as exc:
                    out[i] = exc
                else:  # the bytes changed between the two checks: still not to be trusted
                    out[i] = CorruptValue("checksum mismatch while the value was copied")
        return out
    m = 0
    for i, (key, header, src, target) in enumerate(entries):
        while m < len(marks) and marks[m][0] <= i:
            flags[marks[m][1]] = 1
            m += 1
        try:
            verify(key, header, src, secret)
            scatter_from(src, target)
        except CorruptValue as exc:
            out[i] = exc
        except ValueError as exc:  # a value not the size of its pages
            out[i] = CorruptValue(str(exc))
    for _end, flag in marks[m:]:
        flags[flag] = 1
    return out


def _copy_hashing(dst: memoryview, src: memoryview, update: Callable[[memoryview], object]) -> None:
    """Copy piece by piece, hashing each piece right after its copy; both without the
    GIL (memcopy.move, XXH3), so several workers copy at once. ``dst`` and ``src`` have
    the same length (the callers' slices)."""
    n = len(src)
    where = addresses(dst, src) if len(dst) == n else None
    if where is None:
        for at in range(0, n, PIECE):
            piece = dst[at : at + PIECE]
            copy_bytes(piece, src[at : at + PIECE])
            update(piece)
        return
    to, frm = where
    for at in range(0, n, PIECE):
        move(to + at, frm + at, min(PIECE, n - at))
        update(dst[at : at + PIECE])


def payload_length(header: bytes | memoryview) -> int:
    """Parse a header and return the payload length it announces.

    Raises :class:`CorruptValue` when the magic, version or algorithm is wrong.
    """
    if len(header) < HEADER_SIZE:
        raise CorruptValue(f"header too short: {len(header)} < {HEADER_SIZE} bytes")
    magic, version, algo, _reserved, length, _crc = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if version == VERSION and algo == ALGO_KEYED:
        return int.from_bytes(_KEYED.unpack_from(header)[3], "little")
    if version != VERSION or algo not in _READ_ALGOS:
        raise CorruptValue(f"unsupported frame version={version} algo={algo}")
    return length


def verify(
    key: bytes,
    header: bytes | memoryview,
    payload: bytes | memoryview,
    secret: bytes | None = None,
) -> None:
    """Check ``payload`` against ``header`` for ``key``; raise :class:`CorruptValue` if not.

    With ``secret`` only a keyed frame made with that secret passes; without it only a
    CRC frame does (a keyed value cannot be checked, so it is not served either).
    """
    n = len(payload)
    if (
        secret is None
        and _xxh3_64_int is not None
        and header[:_PREFIX] == (_prefixes.get(n) or _unkeyed_prefix(n))
    ):
        # the common case, checked in two calls: magic, version, algo 4 and length are
        # what this version writes for a payload of this size; only the checksum is left
        seed = _xxh3_64_int(bytes(header[:_PREFIX]) + key)
        if _U32.unpack_from(header, _PREFIX)[0] == _xxh3_64_int(payload, seed) & _LOW32:
            return
    length = payload_length(header)
    if length != len(payload):
        raise CorruptValue(f"length mismatch: header says {length}, got {len(payload)} bytes")
    algo = header[5]
    if secret is not None:
        if algo != ALGO_KEYED:
            raise CorruptValue("unauthenticated (checksum-only) value while a store key is set")
        expected_mac = bytes(header[_KEYED_PREFIX:HEADER_SIZE])
        if not hmac.compare_digest(
            _mac(secret, key, header[:_KEYED_PREFIX], payload), expected_mac
        ):
            raise CorruptValue("authentication failed (written without this store key?)")
        return
    if algo == ALGO_KEYED:
        raise CorruptValue("keyed value but no store key set (set UCM_PATCH_STORE_KEY)")
    (expected,) = struct.unpack_from("<I", header, _PREFIX)
    actual = checksum(key, header[:_PREFIX], payload, algo)
    if actual != expected:
        raise CorruptValue(f"checksum mismatch: stored {expected:#010x}, computed {actual:#010x}")
