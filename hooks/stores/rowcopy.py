"""A row of values copied and verified in one foreign call: the GIL given up once per row.

Why: a load thread that copies and hashes each value piece by piece
(:func:`~.framing.copy_verified`) gives the GIL up for every copy and every checksum.
Beside vLLM's forward, a thread that keeps the GIL, each take back waits up to the switch
interval: on the H100 the load threads spent several times the work of a value waiting
for it (docs/GPU.md, run 4). ``rowcopy.c`` does a whole row's copies and checksums in
one call, piece by piece (each piece of a copy hashed from its source, then written from
the cache it was just read into: rowcopy.c says why). A put's framing of 8 MiB or more
is shared with the process's copier, a thread of the helper (at the priority of the dump
thread that started it) that takes values of the same batch (:func:`copier_stats`;
rowcopy.c says why).

The C file is compiled with the host's C compiler (``$CC``, else ``cc``) the first time a
process needs it, into ``$XDG_CACHE_HOME/ucm_patch/native`` (``~/.cache`` by default;
named by a hash of the source and the machine, replaced atomically), the way Triton and
torch build their helpers; the XXH3 functions it calls are the ones of the ``xxhash``
extension the store already imports, passed by address, so it links nothing. Where there
is no compiler, or the helper fails its self-test, :func:`copy_verify_many` answers None
once and for the life of the process, and the store copies value by value as before,
with one INFO line saying why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import threading
from array import array
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from ucm_patch import environment
from ucm_patch.hooks.stores.memcopy import address, addresses, bytes_address, source_address
from ucm_patch.hooks.stores.scatter import PagePlan, Scatter

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rowcopy.c")
#: What the helper needs of the xxhash library, in ``struct xxh3_api``'s order.
XXH3_SYMBOLS = (
    "XXH3_createState",
    "XXH3_freeState",
    "XXH3_64bits_reset_withSeed",
    "XXH3_64bits_update",
    "XXH3_64bits_digest",
)


class _Api(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in XXH3_SYMBOLS]


class _Helper:
    """The loaded helper: its entry points and the XXH3 functions it calls."""

    def __init__(self, fn: Any, scatter: Any, frame: Any, frame_write: Any, frame_send: Any,
                 wait_flag: Any, api: _Api, keep: tuple[Any, ...]) -> None:  # fmt: skip
        lib = keep[0]
        self.hash_helper_stats = lib.ucm_hash_helper_stats
        self.hash_helper_stats.argtypes = [ctypes.c_void_p]
        self.hash_helper_stats.restype = None
        self.copier_stats = lib.ucm_copier_stats
        self.copier_stats.argtypes = [ctypes.c_void_p]
        self.copier_stats.restype = None
        # the same library through PyDLL: its calls keep the GIL (for a system call of a
        # microsecond, which os.* would give the GIL up around)
        self.fstat_held = ctypes.PyDLL(lib._name).ucm_fstat_held
        self.fstat_held.argtypes = [ctypes.c_int]
        self.fstat_held.restype = ctypes.c_int64
        self.fn = fn
        self.scatter = scatter
        self.frame = frame
        self.frame_write = frame_write
        self.frame_send = frame_send
        self.wait_flag = wait_flag
        self.api = api
        self.keep = keep  # the libraries, loaded for as long as the helper is


_lock = threading.Lock()
_helper: _Helper | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(environment.user_cache_dir()) / "native"


def _built(source: bytes) -> Path:
    """The shared object of ``source`` for this machine: built now unless already there
    (and this user's, writable by nobody else)."""
    tag = hashlib.blake2b(
        source + platform.machine().encode() + platform.system().encode(), digest_size=8
    ).hexdigest()
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = folder / f"rowcopy-{tag}.so"
    if out.exists():
        st = out.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OSError(f"{out} is not this user's alone: not loaded")
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc, gcc or $CC)")
    tmp = folder / f".rowcopy-{tag}.{os.getpid()}.so"
    cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)
    return out


def _xxh3_library() -> ctypes.CDLL:
    """The library holding XXH3's functions: the xxhash extension, or a shared libxxhash
    it was built against."""
    import xxhash._xxhash as ext

    for path in (ext.__file__, ctypes.util.find_library("xxhash")):
        if not path:
            continue
        lib = ctypes.CDLL(path)
        if all(hasattr(lib, name) for name in XXH3_SYMBOLS):
            return lib
    raise OSError("the XXH3 functions are in neither the xxhash extension nor libxxhash")


def _load() -> _Helper:
    lib = ctypes.CDLL(str(_built(SOURCE.read_bytes())))
    fn = lib.ucm_rowcopy
    p = ctypes.c_void_p
    fn.argtypes = [ctypes.c_size_t, p, p, p, p, p, p, p, p, p]
    fn.restype = ctypes.c_int
    scatter = lib.ucm_scatter
    scatter.argtypes = [ctypes.c_size_t, *[p] * 15, ctypes.c_size_t, p, p, p, p, p]
    scatter.restype = ctypes.c_int
    wait = lib.ucm_wait_flag
    wait.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    wait.restype = ctypes.c_int
    frame = lib.ucm_rowframe
    frame.argtypes = [ctypes.c_size_t, p, p, p, p, p, p, p]
    frame.restype = ctypes.c_int
    frame_write = lib.ucm_framewrite
    frame_write.argtypes = [ctypes.c_int, ctypes.c_size_t, *[p] * 11, ctypes.c_int]
    frame_write.restype = ctypes.c_int
    frame_send = lib.ucm_frame_send
    frame_send.argtypes = [ctypes.c_size_t, *[p] * 7, ctypes.c_size_t, p, p, ctypes.c_int, p,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, p]  # fmt: skip
    frame_send.restype = ctypes.c_int
    xxh = _xxh3_library()
    api = _Api(*[ctypes.cast(getattr(xxh, name), p).value for name in XXH3_SYMBOLS])
    helper = _Helper(fn, scatter, frame, frame_write, frame_send, wait, api, (lib, xxh))
    _self_test(helper)
    return helper


def _self_test(helper: _Helper) -> None:
    """The helper's checksum is xxhash's own, on a value of several pieces, and it copies."""
    import xxhash

    src = memoryview(bytearray(os.urandom((600 << 10) + 13)))
    dst = memoryview(bytearray(len(src)))
    seed = 0x1234_5678_9ABC
    want = xxhash.xxh3_64_intdigest(src, seed) & 0xFFFFFFFF
    material = os.urandom(40)
    keyed = xxhash.xxh3_64_intdigest(src, xxhash.xxh3_64_intdigest(material)) & 0xFFFFFFFF
    items = [(dst, src, seed, want), (dst, src, seed, want ^ 1), (dst, None, material, keyed)]
    got = _call(helper, items)
    if got != [True, False, True] or dst != src:
        raise OSError(f"self-test failed: {got}")
    # two pages of 64 bytes, each two runs swapped in place, the second page skipped
    plan = PagePlan(64, ((0, 32, 32), (32, 0, 32)))
    value = memoryview(bytearray(os.urandom(128)))
    out = memoryview(bytearray(64))
    target = Scatter(plan, (address(out) or 0, 0))
    want = xxhash.xxh3_64_intdigest(value, seed) & 0xFFFFFFFF
    flags = (ctypes.c_uint8 * 3)()
    items = [(value, seed, want, target), (value, seed, want ^ 1, target)]
    got = _scatter(helper, items, [(0, 2), (1, 0), (2, 1)], flags)
    if (
        got != [True, False]
        or out != bytes(value[32:64]) + bytes(value[:32])
        or list(flags) != [1, 1, 1]
    ):
        raise OSError(f"scatter self-test failed: {got}, marks {list(flags)}")
    if not helper.wait_flag(ctypes.addressof(flags), 0):
        raise OSError("wait_flag self-test failed")
    copy = memoryview(bytearray(len(src)))
    digests = _frame(helper, [(copy, src, material)])
    framed = xxhash.xxh3_64_intdigest(src, xxhash.xxh3_64_intdigest(material))
    if digests != [framed] or copy != src:
        raise OSError(f"frame self-test failed: {digests} != {[framed]}")
    # enough values for the copier (rowcopy.c): each framed once, by either thread
    copies = [memoryview(bytearray(len(src))) for _ in range(16)]
    digests = _frame(helper, [(c, src, material) for c in copies])
    if digests != [framed] * 16 or any(c != src for c in copies):
        raise OSError(f"frame self-test (shared with the copier) failed: {digests}")
    _self_test_file(helper, src, material, framed)
    _self_test_send(helper, src, material, framed)


def _self_test_send(helper: _Helper, src: memoryview, material: bytes, framed: int) -> None:
    """:func:`frame_send` copies, writes the header, sends the request and sees the
    answer waiting (a pipe each way)."""
    request_r, request_w = os.pipe()
    answer_r, answer_w = os.pipe()
    try:
        os.write(answer_w, b"!")
        copy = memoryview(bytearray(len(src)))
        head = memoryview(bytearray(8))
        planned = send_columns([(copy, src, material, head, b"lead")])
        assert planned is not None  # bytearrays have addresses
        got = _frame_send(helper, *planned, request_w, b"request", answer_r, 1.0)
        sent = os.read(request_r, 64)
    finally:
        for fd in (request_r, request_w, answer_r, answer_w):
            os.close(fd)
    want = b"lead" + (framed & 0xFFFFFFFF).to_bytes(4, "little")
    if got != (SEND_ANSWERED, [framed], 0) or copy != src or head != want or sent != b"request":
        raise OSError(f"send self-test failed: {got}")


def _self_test_file(helper: _Helper, src: memoryview, material: bytes, framed: int) -> None:
    """:func:`frame_write_many` writes the value and its header where it was told."""
    import tempfile

    head = bytearray(b"h" * 8)
    with tempfile.TemporaryFile() as f:
        digests = _frame_write(helper, f.fileno(), [(8, src, material, head, 2, 0)])
        f.seek(0)
        back = f.read()
    want = b"hh" + (framed & 0xFFFFFFFF).to_bytes(4, "little") + b"hh" + bytes(src)
    if digests != [framed] or back != want:
        raise OSError(f"file frame self-test failed: {digests} != {[framed]}")


def _get() -> _Helper | None:
    global _helper, _tried
    if _tried:
        return _helper
    with _lock:
        if not _tried:
            try:
                _helper = _load()
            except (OSError, subprocess.SubprocessError, ImportError, AttributeError) as exc:
                log.info(
                    "ucm_patch: row copies value by value (native helper unavailable: %s)", exc
                )
            _tried = True
    return _helper


def available() -> bool:
    """Whether rows are copied in one call in this process (built and loaded on first use)."""
    return _get() is not None


def disable() -> None:
    """Copy value by value from now on in this process, as on a host with no C compiler
    (benchmarks that compare the two paths)."""
    global _helper, _tried
    with _lock:
        _helper, _tried = None, True


#: One value of :func:`copy_verify_many`: (dst, src or None, seed, want); the seed an
#: int, or the bytes whose XXH3-64 is the seed (hashed in the same call).
Item = tuple[memoryview, memoryview | None, int | bytes, int]


def copy_verify_many(items: Sequence[Item]) -> list[bool] | None:
    """For each (dst, src, seed, want): copy ``src`` into ``dst`` (same length; src None:
    ``dst`` is only checked) and check the low 32 bits of XXH3-64 of the bytes copied
    (hashed as they are read from ``src``), seeded, against ``want``, all in one call
    without the GIL: True per value that checks. A caller whose source may be rewritten
    meanwhile checks afterwards that it was not (a store: the segment's generation). A
    ``bytes``
    seed is hashed in that call too (XXH3-64 of it is the seed). None when the helper is
    unavailable or a buffer has no address (read-only, not contiguous): the caller then
    does it value by value."""
    helper = _get()
    if helper is None or not items:
        return None if helper is None else []
    return _call(helper, items)


def _call(helper: _Helper, items: Sequence[Item]) -> list[bool] | None:
    n = len(items)
    dst = (ctypes.c_void_p * n)()
    src = (ctypes.c_void_p * n)()
    size = (ctypes.c_size_t * n)()
    seed = (ctypes.c_uint64 * n)()
    seed_src = (ctypes.c_void_p * n)()
    seed_len = (ctypes.c_size_t * n)()
    want = (ctypes.c_uint32 * n)()
    ok = (ctypes.c_uint8 * n)()
    for i, (d, s, sd, w) in enumerate(items):
        if s is not None and len(s) != len(d):
            raise ValueError(f"copy_verify_many: item {i}: dst has {len(d)} bytes, src {len(s)}")
        at = addresses(d, d if s is None else s)
        if at is None:
            return None
        dst[i], src[i] = at[0], (at[1] if s is not None else None)
        size[i], want[i] = len(d), w
        if type(sd) is bytes:  # kept alive by ``items`` for the call
            seed_src[i], seed_len[i] = bytes_address(sd), len(sd)
        else:
            seed[i] = sd
    api = ctypes.byref(helper.api)
    if helper.fn(n, dst, src, size, seed, seed_src, seed_len, want, api, ok) != 0:
        return None
    return [bool(x) for x in ok]


#: One value of :func:`frame_many`: (dst, src, the bytes whose XXH3-64 is the seed).
FrameItem = tuple[memoryview, memoryview | bytes, bytes]


def frame_many(items: Sequence[FrameItem]) -> list[int] | None:
    """For each (dst, src, seed material): copy ``src`` into ``dst`` (same length) and
    answer XXH3-64 of the copy, seeded with XXH3-64 of the material, every value in one
    call without the GIL (a put's frames: :func:`~.framing.copy_framed_many`). None when
    the helper is unavailable or a buffer has no address: the caller then frames value
    by value."""
    helper = _get()
    if helper is None or not items:
        return None if helper is None else []
    return _frame(helper, items)


def _frame(helper: _Helper, items: Sequence[FrameItem]) -> list[int] | None:
    n = len(items)
    dst = (ctypes.c_void_p * n)()
    src = (ctypes.c_void_p * n)()
    size = (ctypes.c_size_t * n)()
    seed_src = (ctypes.c_void_p * n)()
    seed_len = (ctypes.c_size_t * n)()
    digest = (ctypes.c_uint64 * n)()
    for i, (d, s, material) in enumerate(items):
        if len(s) != len(d):
            raise ValueError(f"frame_many: item {i}: dst has {len(d)} bytes, src {len(s)}")
        at = addresses(d, s)
        if at is None:
            return None
        dst[i], src[i], size[i] = at[0], at[1], len(d)
        seed_src[i], seed_len[i] = bytes_address(material), len(material)
    api = ctypes.byref(helper.api)
    if helper.frame(n, dst, src, size, seed_src, seed_len, api, digest) != 0:
        return None
    return list(digest)


#: One value of :func:`frame_write_many`: (payload offset, src, the bytes whose XXH3-64 is
#: the seed, the record's header (a bytearray: its checksum is written into it), where in
#: the header the checksum goes, the header's offset).
FileFrameItem = tuple[int, memoryview | bytes, bytes, bytearray, int, int]


def frame_write_many(
    fd: int, items: Sequence[FileFrameItem], beside: bool = False
) -> list[int] | None:
    """For each item: write ``src`` into the file ``fd`` at its payload offset, put the
    low 32 bits of XXH3-64 of it (seeded with XXH3-64 of the material) little-endian into
    the header at its place, and write the header at its offset; answer the XXH3-64s.
    Every value in one call without the GIL (a put into a file segment). None when the
    helper is unavailable or a buffer has no address: the caller then writes the usual
    way. An ``OSError`` names the write that failed; what came before it may be written.

    ``beside``: the process's checksum helper thread hashes the values while this thread
    writes them, where it is free to start at once (``ucm_framewrite``); for a writer
    with nothing else of its store working beside it (a store with a disk tier only)."""
    helper = _get()
    if helper is None or not items:
        return None if helper is None else []
    return _frame_write(helper, fd, items, beside)


def _frame_write(
    helper: _Helper, fd: int, items: Sequence[FileFrameItem], beside: bool = False
) -> list[int] | None:
    n = len(items)
    pay_at = (ctypes.c_int64 * n)()
    src = (ctypes.c_void_p * n)()
    size = (ctypes.c_size_t * n)()
    seed_src = (ctypes.c_void_p * n)()
    seed_len = (ctypes.c_size_t * n)()
    head = (ctypes.c_void_p * n)()
    head_len = (ctypes.c_size_t * n)()
    sum_at = (ctypes.c_size_t * n)()
    head_at = (ctypes.c_int64 * n)()
    digest = (ctypes.c_uint64 * n)()
    for i, (at, s, material, header, where, header_at) in enumerate(items):
        if not 0 <= where <= len(header) - 4:
            raise ValueError(f"frame_write_many: item {i}: checksum at {where} of a "
                             f"{len(header)}-byte header")  # fmt: skip
        source, into = source_address(s), address(header)
        if source is None or into is None:
            return None
        pay_at[i], src[i], size[i] = at, source, len(s)
        seed_src[i], seed_len[i] = bytes_address(material), len(material)
        head[i], head_len[i], sum_at[i], head_at[i] = into, len(header), where, header_at
    api = ctypes.byref(helper.api)
    err = helper.frame_write(fd, n, pay_at, src, size, seed_src, seed_len, head, head_len,
                             sum_at, head_at, api, digest, int(beside))  # fmt: skip
    if err == -1:
        return None
    if err:
        raise OSError(err, f"frame_write_many: writing fd {fd}: {os.strerror(err)}")
    return list(digest)


class HashHelperStats(NamedTuple):
    """The checksum helper of :func:`frame_write_many` in this process, counted since it
    started (or since a fork): batches given to it, values it hashed, values their
    writers took back and hashed themselves (it had not begun them), whether its thread
    runs."""

    posted: int
    hashed: int
    taken_back: int
    running: bool


def hash_helper_stats() -> HashHelperStats | None:
    """:class:`HashHelperStats`, or None without the row helper."""
    helper = _get()
    return None if helper is None else HashHelperStats(*_counts(helper.hash_helper_stats))


class CopierStats(NamedTuple):
    """The copier of :func:`frame_many` and :func:`frame_send` in this process (the
    second thread that frames a put's values beside the caller's, rowcopy.c), counted
    since it started (or since a fork): batches shared with it, values it framed,
    batches it never began (its caller framed every value first), whether its thread
    runs."""

    posted: int
    framed: int
    unstarted: int
    running: bool


class FileState(NamedTuple):
    """What :func:`fstat_held` answers of a file (the fields of ``os.stat_result`` that
    a segment's check reads): its size, and 1 for a file with links (its count is not
    kept), 0 for one deleted."""

    st_size: int
    st_nlink: int


def fstat_held(fd: int) -> FileState | os.stat_result:
    """``os.fstat(fd)``'s size and link count, the GIL kept for the call where the helper
    is built (else ``os.fstat``, which gives it up). For a file whose ``fstat`` never
    waits for a device (a memory tier's, on a tmpfs): a dump or load thread beside the
    forward checks each segment's file once per batch, and each give-up of the GIL there
    costs a take back, up to the switch interval. OSError as ``os.fstat``'s."""
    helper = _get()
    if helper is None:
        return os.fstat(fd)
    size = helper.fstat_held(fd)
    if size >= 0:
        return FileState(size, 1)  # linked at least once: all a check asks
    if size == -1:
        return _REMOVED
    err = -2 - size
    raise OSError(err, f"fstat of fd {fd}: {os.strerror(err)}")


_REMOVED = FileState(0, 0)  # a file with no link left (deleted behind the store)


def copier_stats() -> CopierStats | None:
    """:class:`CopierStats`, or None without the row helper."""
    helper = _get()
    return None if helper is None else CopierStats(*_counts(helper.copier_stats))


def _counts(read: Any) -> tuple[int, int, int, bool]:
    """What a helper thread's stats function writes: three counts and whether it runs."""
    out = (ctypes.c_uint64 * 4)()
    read(out)
    return out[0], out[1], out[2], bool(out[3])


#: What :func:`frame_send` did: copied, sent, the answer readable; copied, sent, no
#: answer in time; copied, the request not written whole (the channel is unusable).
SEND_ANSWERED, SEND_LATE, SEND_CUT = 0, 1, 2


class SendColumns(NamedTuple):
    """A put's values for :func:`frame_send`, one ``array`` of C words (:data:`WORD`) per
    field, entry ``i`` of each for value ``i``: where it goes, where it is read from, its
    bytes, where its seed material starts and its length (the seed is XXH3-64 of it), where
    its record header goes and where that header's bytes before the checksum are read
    from (``head_len`` of them, the same for every value). Every address points into an
    object the caller holds until the call returns, and was bounds-checked by whoever
    placed the value (a copy out of bounds is not caught here)."""

    dst: array[int]
    src: array[int]
    size: array[int]
    seed_src: array[int]
    seed_len: array[int]
    head_dst: array[int]
    head_src: array[int]


def frame_send(
    cols: SendColumns, head_len: int, request_fd: int, request: bytes, answer_fd: int,
    timeout_s: float,
) -> tuple[int, list[int], int] | None:  # fmt: skip
    """A put's copies and its publish request in one call without the GIL: each value
    copied and framed as :func:`frame_many` does, its record header (the ``head_len``
    bytes given, then the low 32 bits of the checksum, little-endian) written into
    place, then ``request`` written to ``request_fd`` and ``answer_fd`` waited on until
    it has something to read, both within ``timeout_s``. (:data:`SEND_ANSWERED` /
    :data:`SEND_LATE` / :data:`SEND_CUT`, the XXH3-64s, the errno of a write that
    failed); None when nothing was done (no helper, no values). ValueError when the
    columns differ in length."""
    helper = _get()
    if helper is None or not cols.dst:
        return None
    return _frame_send(helper, cols, head_len, request_fd, request, answer_fd, timeout_s)


def _frame_send(
    helper: _Helper, cols: SendColumns, head_len: int, request_fd: int, request: bytes,
    answer_fd: int, timeout_s: float,
) -> tuple[int, list[int], int] | None:  # fmt: skip
    # Columns by address, as _scatter's: this runs on a dump thread with the GIL held,
    # beside the forward (docs/CONNECTOR.md, "the Python before a dump's native copy").
    n = len(cols.dst)
    for name, column in zip(SendColumns._fields, cols, strict=True):
        if len(column) != n or column.typecode != _WORD:
            raise ValueError(f"frame_send: column {name} has {len(column)} entries of "
                             f"{column.typecode!r}, want {n} of {_WORD!r}")  # fmt: skip
    digest = (ctypes.c_uint64 * n)()
    err = ctypes.c_int(0)
    code = helper.frame_send(
        n, *map(_at, cols), head_len, ctypes.byref(helper.api), digest, request_fd,
        bytes_address(request), len(request), answer_fd, int(timeout_s * 1e9),
        ctypes.byref(err),
    )  # fmt: skip
    if code < 0:
        return None
    return code, list(digest), err.value


def send_columns(
    items: Sequence[tuple[memoryview, memoryview | bytes, bytes, memoryview, bytes]],
) -> tuple[SendColumns, int] | None:
    """:class:`SendColumns` of (dst, src, seed material, the record header's place (its
    bytes and 4 more), the header's bytes before the checksum) per value, each buffer
    checked here: (the columns, ``head_len``), pointing into ``items``, which the caller
    holds until the call; None where a buffer has no address. For a few values (the
    self-test): a put builds its columns from the places it computed
    (:func:`~.framing.copy_framed_send`)."""
    cols = SendColumns(*_cols(_WORD, 7))
    head_len = len(items[0][4]) if items else 0
    for i, (d, s, material, head, lead) in enumerate(items):
        if len(s) != len(d) or len(lead) != head_len or len(head) != head_len + 4:
            raise ValueError(f"send_columns: item {i}: dst {len(d)} bytes, src {len(s)}, "
                             f"header {len(head)} for {len(lead)} + 4")  # fmt: skip
        at, into = addresses(d, s), address(head)
        if at is None or into is None:
            return None
        values = (at[0], at[1], len(d), bytes_address(material), len(material), into,
                  bytes_address(lead))  # fmt: skip
        for column, value in zip(cols, values, strict=True):
            column.append(value)
    return cols, head_len


#: One value of :func:`scatter_verify_many`: (src, seed, want, target); the seed as in
#: :data:`Item`.
ScatterItem = tuple[memoryview, int | bytes, int, Scatter]


#: Rows of a KV cache marked done while a call runs (:func:`scatter_verify_many`): after
#: the values before ``end`` are done, ``flags[flag] = 1``, per (end, flag), in order.
Marks = Sequence[tuple[int, int]]


def scatter_verify_many(
    items: Sequence[ScatterItem], marks: Marks = (), flags: Any = None
) -> list[bool] | None:
    """For each (src, seed, want, target): write ``src``'s pages where ``target`` says
    (:mod:`.scatter`) and check the low 32 bits of XXH3-64(src, seed) against ``want``,
    every value in one call without the GIL: True per value that checks (a False one's
    pages were written, and hold nothing usable). ``marks`` into ``flags`` (a ctypes
    ``uint8`` array): each set as soon as the values before its end are done, all of them
    by the return. None when the helper is unavailable or a source has no address (no
    mark set): the caller then does it value by value."""
    helper = _get()
    if helper is None:
        return None
    return _scatter(helper, items, marks, flags)


def _scatter(
    helper: _Helper, items: Sequence[ScatterItem], marks: Marks = (), flags: Any = None
) -> list[bool] | None:
    # The arguments are built as ``array`` columns and handed over by address, not set
    # element by element into ctypes arrays: this runs on a load thread with the GIL held,
    # the other load thread waiting for it meanwhile (docs/CONNECTOR.md, "The Python
    # before a load's native copy", has the figures).
    n = len(items)
    plans: list[PagePlan] = []
    index: dict[int, int] = {}  # id(plan) -> its index in ``plans``
    plan_of, src, size, first, seed, seed_src, seed_len = _cols(_WORD, 7)
    want = array("I")
    at = 0
    for i, (s, sd, w, t) in enumerate(items):
        pages, plan = t.pages, t.plan
        nbytes = len(s)
        if nbytes != len(pages) * plan.page_bytes:
            raise ValueError(f"scatter_verify_many: item {i}: src has {nbytes} bytes, "
                             f"its target {t.nbytes}")  # fmt: skip
        where = source_address(s)
        if where is None:
            return None
        p = index.get(id(plan))
        if p is None:
            p = index[id(plan)] = len(plans)
            plans.append(plan)
        plan_of.append(p)
        src.append(where)
        size.append(nbytes)
        want.append(w)
        first.append(at)
        at += len(pages)
        if type(sd) is bytes:  # kept alive by ``items`` for the call
            seed.append(0)
            seed_src.append(bytes_address(sd))
            seed_len.append(len(sd))
        else:
            seed.append(sd)
            seed_src.append(0)
            seed_len.append(0)
    # every page of every value, 0 for one not written (NULL)
    dst_page = array(_WORD, chain.from_iterable(t.pages for _s, _sd, _w, t in items))
    runs = [r for p in plans for r in p.runs]
    run_first, run_count, start = array(_WORD), array(_WORD), 0
    for p in plans:
        run_first.append(start)
        run_count.append(len(p.runs))
        start += len(p.runs)
    if marks and flags is None:
        raise ValueError("scatter_verify_many: marks without flags")
    ok = (ctypes.c_uint8 * max(1, n))()
    # every column named here, so that each lives until the call returns
    page_bytes = array(_WORD, [p.page_bytes for p in plans])
    run_src, run_dst, run_len = (array(_WORD, [r[k] for r in runs]) for k in range(3))
    mark_end = array(_WORD, [e for e, _f in marks])
    mark_flag = array(_WORD, [f for _e, f in marks])
    columns = (src, size, seed, seed_src, seed_len, want, plan_of, page_bytes, run_first,
               run_count, run_src, run_dst, run_len, first, dst_page)  # fmt: skip
    args = (n, *map(_at, columns), len(marks), _at(mark_end), _at(mark_flag), flags,
            ctypes.byref(helper.api), ok)  # fmt: skip
    if helper.scatter(*args) != 0:
        return None
    return [x != 0 for x in ok[:n]]


#: The ``array`` typecode of a C ``size_t`` (and of a pointer: the same width wherever
#: vLLM runs), for the helper's argument columns.
_WORD = next(c for c in "QLI" if array(c).itemsize == ctypes.sizeof(ctypes.c_size_t))
#: The typecode of :class:`SendColumns`' columns, for the callers that build them.
WORD = _WORD


def _cols(typecode: str, k: int) -> tuple[array[int], ...]:
    """``k`` empty ``array`` columns of ``typecode``."""
    return tuple(array(typecode) for _ in range(k))


def _at(column: array[int]) -> int | None:
    """Where ``column``'s items start (None, a NULL, when it has none: the helper reads
    none of it then); valid while the caller holds ``column`` and does not grow it."""
    return column.buffer_info()[0] if len(column) else None


def wait_flag(flag_address: int, timeout_s: float) -> bool:
    """Wait for the ``uint8`` at ``flag_address`` to be set (by :func:`scatter_verify_many`
    on another thread), without the GIL, at most ``timeout_s``: whether it was. False at
    once when the helper is unavailable (the caller waits its own way)."""
    helper = _get()
    if helper is None:
        return False
    return bool(helper.wait_flag(flag_address, int(timeout_s * 1e9)))


__all__ = [
    "SOURCE",
    "WORD",
    "XXH3_SYMBOLS",
    "CopierStats",
    "FileState",
    "FrameItem",
    "HashHelperStats",
    "Item",
    "Marks",
    "ScatterItem",
    "SendColumns",
    "available",
    "copier_stats",
    "copy_verify_many",
    "disable",
    "frame_many",
    "frame_send",
    "fstat_held",
    "hash_helper_stats",
    "scatter_verify_many",
    "send_columns",
    "wait_flag",
]
