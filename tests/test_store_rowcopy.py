"""A row of values read into buffers is copied and verified in one foreign call (the GIL
given up once per row, not twice per 256 KiB piece), by a C helper built on first use;
without it (no compiler), the store reads value by value as before, with the same
answers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores import framing, rowcopy
from ucm_patch.hooks.stores.local import LocalStore

VALUE = (1 << 20) + 4096  # several pieces of framing.PIECE, not a multiple of one


def _store(root: Path) -> LocalStore:
    return LocalStore(
        root / "kv", 256 << 20, memory_bytes=64 << 20, memory_path=root / "shm", value_bytes=VALUE
    )


def _row(n: int) -> dict[str, bytes]:
    return {f"row/{i}": os.urandom(VALUE) for i in range(n)}


def _read(store: LocalStore, values: dict[str, bytes]) -> tuple[list[bool], list[memoryview]]:
    bufs = [memoryview(bytearray(VALUE)) for _ in values]
    return store.get_many_into(list(values), bufs), bufs


def test_a_row_is_one_call_and_no_piece_copy(tmp_path: Path, monkeypatch) -> None:
    assert rowcopy.available(), "the helper did not build here (cc and xxhash are present)"
    calls: list[int] = []
    real = rowcopy._call
    monkeypatch.setattr(
        rowcopy, "_call", lambda h, items: calls.append(len(items)) or real(h, items)
    )
    pieces: list[int] = []
    monkeypatch.setattr(framing, "move", lambda *a: pieces.append(1))  # the old per-piece copy
    s = _store(tmp_path)
    values = _row(25)
    assert all(s.put_many(list(values.items())))
    ok, bufs = _read(s, values)
    assert ok == [True] * 25
    assert [bytes(b) for b in bufs] == list(values.values())
    assert calls == [25] and pieces == []
    s.close()


def test_a_corrupt_value_in_the_row_is_dropped_alone(tmp_path: Path) -> None:
    """One byte of one value changed in the memory tier's segment: that value answers
    False and counts as corrupt (its entry dropped); the others of the row are served."""
    s = _store(tmp_path)
    values = _row(6)
    assert all(s.put_many(list(values.items())))
    loc = s.where("row/3")
    assert loc is not None and loc.tier == "memory"
    with open(os.path.join(s.memory.path, loc.file), "r+b") as f:  # type: ignore[union-attr]
        f.seek(loc.offset + 777)
        byte = f.read(1)
        f.seek(loc.offset + 777)
        f.write(bytes([byte[0] ^ 0x40]))
    ok, bufs = _read(s, values)
    assert ok == [True, True, True, False, True, True]
    assert s.stats["corrupt"] == 1
    assert [bytes(b) for i, b in enumerate(bufs) if i != 3] == [
        v for i, v in enumerate(values.values()) if i != 3
    ]
    assert s.get_many(["row/3"]) == [None]  # dropped, not served later
    s.close()


def test_without_the_helper_the_answers_are_the_same(tmp_path: Path, monkeypatch) -> None:
    """No C compiler: the helper is not built (one INFO line), and the store reads value
    by value with the same answers, corrupt values included."""
    monkeypatch.setattr(rowcopy, "_helper", None)
    monkeypatch.setattr(rowcopy, "_tried", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(rowcopy.shutil, "which", lambda name: None)
    assert not rowcopy.available()
    assert rowcopy.copy_verify_many([(memoryview(bytearray(8)), None, 0, 0)]) is None
    s = _store(tmp_path)
    values = _row(4)
    assert all(s.put_many(list(values.items())))
    ok, bufs = _read(s, values)
    assert ok == [True] * 4 and [bytes(b) for b in bufs] == list(values.values())
    s.close()


def test_the_helper_checks_what_xxhash_checks(tmp_path: Path) -> None:
    """Copies, checks in place (src None), seeds from bytes it hashes itself (a frame's
    header and key), and answers per value: a wrong checksum or a different length of a
    value is never taken for a right one."""
    import xxhash

    assert rowcopy.available()
    srcs = [memoryview(bytearray(os.urandom(n))) for n in (1, 4096, 300_000, 1 << 20)]
    dsts = [memoryview(bytearray(len(s))) for s in srcs]
    seeds = [3, 1 << 40, 7, 2**64 - 1]
    want = [xxhash.xxh3_64_intdigest(s, sd) & 0xFFFFFFFF for s, sd in zip(srcs, seeds, strict=True)]
    items = list(zip(dsts, srcs, seeds, want, strict=True))
    assert rowcopy.copy_verify_many(items) == [True] * 4
    assert [bytes(d) for d in dsts] == [bytes(s) for s in srcs]
    wrong = [(d, None, sd, w ^ 0x100) for d, _s, sd, w in items]
    assert rowcopy.copy_verify_many(wrong) == [False] * 4
    in_place = [(d, None, sd, w) for d, _s, sd, w in items]
    assert rowcopy.copy_verify_many(in_place) == [True] * 4
    material = [os.urandom(20 + i) for i in range(4)]  # a frame's header and key
    keyed = [xxhash.xxh3_64_intdigest(s, xxhash.xxh3_64_intdigest(m)) & 0xFFFFFFFF
             for s, m in zip(srcs, material, strict=True)]  # fmt: skip
    assert (
        rowcopy.copy_verify_many(list(zip(dsts, srcs, material, keyed, strict=True))) == [True] * 4
    )
    keyed[2] ^= 1
    assert rowcopy.copy_verify_many(list(zip(dsts, srcs, material, keyed, strict=True))) == [
        True, True, False, True
    ]  # fmt: skip
    with pytest.raises(ValueError, match="item 0: dst has 1 bytes, src 2"):
        rowcopy.copy_verify_many([(dsts[0], memoryview(b"ab"), 0, 0)])


def test_a_copy_is_exact_at_any_alignment_and_length() -> None:
    """The copy is hashed from the source a piece at a time and streamed out 16 bytes
    aligned (``copy_run``): every byte lands, whatever the destination's alignment and
    wherever a length ends against a piece or a 64-byte line, and a source byte changed
    anywhere is caught."""
    import xxhash

    assert rowcopy.available()
    piece = 128 << 10
    for n in (4095, 4096 + 17, piece - 1, piece + 65, 3 * piece + 4097):
        src = memoryview(bytearray(os.urandom(n)))
        want = xxhash.xxh3_64_intdigest(src, 5) & 0xFFFFFFFF
        for shift in (0, 1, 7, 15):
            room = bytearray(n + 32)
            dst = memoryview(room)[shift : shift + n]
            assert rowcopy.copy_verify_many([(dst, src, 5, want)]) == [True], (n, shift)
            assert bytes(dst) == bytes(src), (n, shift)
            assert room[:shift] == bytes(shift) and room[shift + n :] == bytes(32 - shift)
        for at in (0, n // 2, n - 1):
            bad = bytearray(src)
            bad[at] ^= 0x40
            dst = memoryview(bytearray(n))
            assert rowcopy.copy_verify_many([(dst, memoryview(bad), 5, want)]) == [False], at


def test_a_put_batch_is_copied_and_framed_in_one_call(tmp_path: Path, monkeypatch) -> None:
    """A dump's batch into the memory tier: one foreign call copies and frames every value
    (the GIL given up once per batch); the frames are the ones ``make_header`` computes,
    so every reader (native or not) verifies them."""
    assert rowcopy.available()
    calls: list[tuple[int, bool]] = []
    real = rowcopy._frame

    def counted(h: object, items: list) -> list[int] | None:
        got = real(h, items)  # None: it copied nothing, the store went value by value
        calls.append((len(items), got is not None))
        return got

    monkeypatch.setattr(rowcopy, "_frame", counted)
    s = _store(tmp_path)
    values = _row(4)  # bytes: read-only buffers, copied natively all the same
    assert all(s.put_many(list(values.items())))
    assert calls == [(4, True)]
    for key, value in values.items():
        loc = s.where(key)
        assert loc is not None and loc.tier == "memory"
        with open(os.path.join(s.memory.path, loc.file), "rb") as f:  # type: ignore[union-attr]
            f.seek(loc.offset - framing.HEADER_SIZE)
            header = f.read(framing.HEADER_SIZE)
        assert header == framing.make_header(key.encode(), memoryview(value))
    ok, bufs = _read(s, values)
    assert ok == [True] * 4 and [bytes(b) for b in bufs] == list(values.values())
    monkeypatch.setattr(rowcopy, "_helper", None)  # the value-by-value reads agree
    monkeypatch.setattr(rowcopy, "_tried", True)
    assert s.get_many(list(values)) == list(values.values())
    s.close()


def _disk_store(root: Path) -> LocalStore:
    return LocalStore(root / "kv", 256 << 20, memory_bytes=0, value_bytes=VALUE)


def test_a_disk_put_batch_is_hashed_and_written_in_one_call(tmp_path: Path, monkeypatch) -> None:
    """A batch into a file segment: one foreign call hashes and writes every value and its
    record header (no second thread: the sidecar is never started); the frames are the
    ones ``make_header`` computes, and both readers verify them."""
    from ucm_patch.hooks.stores import tier_writes

    assert rowcopy.available()
    calls: list[int] = []
    real = rowcopy._frame_write
    monkeypatch.setattr(rowcopy, "_frame_write", lambda h, fd, items, *a: calls.append(len(items))
                        or real(h, fd, items, *a))  # fmt: skip

    def no_sidecar() -> None:
        raise AssertionError("a disk put started the sidecar")

    monkeypatch.setattr(tier_writes, "sidecar", no_sidecar)
    s = _disk_store(tmp_path)
    assert s.memory is None
    values = _row(3)
    assert all(s.put_many(list(values.items())))
    assert calls == [3]
    for key, value in values.items():
        loc = s.where(key)
        assert loc is not None and loc.tier == "disk"
        with open(os.path.join(s.disk.path, loc.file), "rb") as f:
            f.seek(loc.offset - framing.HEADER_SIZE)
            header = f.read(framing.HEADER_SIZE)
        assert header == framing.make_header(key.encode(), memoryview(value))
    ok, bufs = _read(s, values)
    assert ok == [True] * 3 and [bytes(b) for b in bufs] == list(values.values())
    monkeypatch.setattr(rowcopy, "_helper", None)  # the value-by-value reads agree
    monkeypatch.setattr(rowcopy, "_tried", True)
    assert s.get_many(list(values)) == list(values.values())
    s.close()


def test_a_file_write_that_fails_names_the_descriptor(tmp_path: Path) -> None:
    """A write the kernel refuses raises an OSError with its errno and the descriptor;
    a checksum place outside the header is refused before anything is written."""
    import errno

    value = memoryview(bytearray(os.urandom(300 << 10)))
    with open(tmp_path / "ro", "wb") as f:
        f.write(b"x")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=f"writing fd {fd}") as err:
            rowcopy.frame_write_many(fd, [(64, value, b"k", bytearray(64), 60, 0)])
        assert err.value.errno == errno.EBADF
        with pytest.raises(ValueError, match="item 0: checksum at 62 of a 64-byte header"):
            rowcopy.frame_write_many(fd, [(64, value, b"k", bytearray(64), 62, 0)])
    finally:
        os.close(fd)
    assert (tmp_path / "ro").read_bytes() == b"x"


def test_a_failed_disk_batch_write_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    """The one-call write into a file segment fails (the kernel refuses it): the put
    raises a StoreError naming it, none of the batch is published, nothing is counted
    corrupt, and the next put and the values before it are fine."""
    from ucm_patch.hooks.stores.base import StoreError
    from ucm_patch.hooks.stores.segment_files import FileSegments

    s = _disk_store(tmp_path)
    before = _row(1)
    assert s.put_many(list(before.items())) == [True]
    real = FileSegments.live_fd
    read_only: list[int] = []

    def refusing(self, seg, create=False):  # a descriptor the kernel will not write
        fd = os.open(self.where(seg), os.O_RDONLY)
        read_only.append(fd)
        return fd, os.fstat(fd)

    monkeypatch.setattr(FileSegments, "live_fd", refusing)
    lost = {f"lost/{i}": os.urandom(VALUE) for i in range(2)}
    with pytest.raises(StoreError, match="Bad file descriptor"):
        s.put_many(list(lost.items()))
    monkeypatch.setattr(FileSegments, "live_fd", real)
    for fd in read_only:
        os.close(fd)
    assert s.get_many(list(lost)) == [None, None]
    after = {f"after/{i}": os.urandom(VALUE) for i in range(2)}
    assert all(s.put_many(list(after.items())))
    both = before | after
    assert s.get_many(list(both)) == list(both.values())
    assert s.stats["errors"] == 1 and s.stats["corrupt"] == 0, s.stats
    s.close()
