"""A disk-tier put's checksum on a second core: the process's checksum helper thread
(``ucm_framewrite`` in hooks/stores/rowcopy.c) hashes a batch's values while the writer
writes them. Whatever the helper does (hashes a value, is taken back, is busy, is gone
after a fork, meets a failed write) the checksums are xxhash's and the bytes are the
caller's; and a store puts through it only where it has a disk tier alone."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm_patch.hooks.stores import framing, rowcopy
from ucm_patch.hooks.stores.local import LocalStore

VALUE = (1 << 20) + 4096  # more than one write piece, not a multiple of one
HEAD = 64


def _items(values: list[bytes], base: int = 0) -> list[rowcopy.FileFrameItem]:
    """Records laid out one after another from ``base``: a 64-byte header (checksum at
    60), then the payload; the material is a per-value key."""
    items, at = [], base
    for i, v in enumerate(values):
        items.append((at + HEAD, v, b"key/%d" % i, bytearray(b"h" * HEAD), HEAD - 4, at))
        at += HEAD + len(v)
    return items


def _want(values: list[bytes]) -> list[int]:
    return [
        xxhash.xxh3_64_intdigest(v, xxhash.xxh3_64_intdigest(b"key/%d" % i))
        for i, v in enumerate(values)
    ]


def _check_file(path: Path, values: list[bytes], digests: list[int]) -> None:
    data, at = path.read_bytes(), 0
    for v, d in zip(values, digests, strict=True):
        head = data[at : at + HEAD]
        assert head[: HEAD - 4] == b"h" * (HEAD - 4)
        assert head[HEAD - 4 :] == (d & 0xFFFFFFFF).to_bytes(4, "little")
        assert data[at + HEAD : at + HEAD + len(v)] == v
        at += HEAD + len(v)


def _write_beside(path: Path, values: list[bytes]) -> list[int]:
    """``values`` written into a new file at ``path`` beside the helper, the digests,
    headers and payloads checked; the digests."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = rowcopy.frame_write_many(fd, _items(values), beside=True)
    finally:
        os.close(fd)
    assert got == _want(values)
    _check_file(path, values, got)
    return got


def _stats() -> rowcopy.HashHelperStats:
    got = rowcopy.hash_helper_stats()
    assert got is not None, "the row helper did not build here (cc and xxhash are present)"
    return got


def test_the_helper_hashes_while_the_writer_writes(tmp_path: Path) -> None:
    """Batches written beside the helper: it starts, hashes values of theirs, and every
    digest, header and payload is what a one-thread write gives."""
    before = _stats()
    hashed = before.hashed
    for round_ in range(200):  # the helper runs on the other core; a busy host delays it
        path = tmp_path / f"seg-{round_}"
        _write_beside(path, [os.urandom(VALUE) for _ in range(2)])
        path.unlink()
        if _stats().hashed > hashed:
            break
    after = _stats()
    assert after.running and after.posted > before.posted
    assert after.hashed > hashed, f"the helper hashed no value in 200 batches: {after}"


def test_values_the_helper_has_not_begun_are_taken_back(tmp_path: Path) -> None:
    """Writes that cost nothing (/dev/null): the writer needs each checksum before the
    helper wakes, takes the values back and hashes them itself, with the same answers.
    (On a busy host the helper's wake-up may run it first: the loop gives it turns.)"""
    values = [os.urandom(256 << 10) for _ in range(32)]
    before = _stats()
    fd = os.open(os.devnull, os.O_WRONLY)
    rounds = 0
    try:
        while rounds < 200 and _stats().taken_back == before.taken_back:
            assert rowcopy.frame_write_many(fd, _items(values), beside=True) == _want(values)
            rounds += 1
    finally:
        os.close(fd)
    after = _stats()
    assert after.taken_back > before.taken_back, after
    done = (after.hashed - before.hashed) + (after.taken_back - before.taken_back)
    assert done <= rounds * len(values)  # no value hashed twice over


def test_without_beside_the_helper_gets_nothing(tmp_path: Path) -> None:
    """A two-tier store's writes (beside not set) never wake the helper, and small
    batches (below a wake-up's worth) neither."""
    before = _stats()
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        big = [os.urandom(VALUE) for _ in range(2)]
        assert rowcopy.frame_write_many(fd, _items(big)) == _want(big)
        small = [os.urandom(4096) for _ in range(4)]
        assert rowcopy.frame_write_many(fd, _items(small), beside=True) == _want(small)
    finally:
        os.close(fd)
    assert _stats().posted == before.posted


def test_a_busy_helper_leaves_other_writers_alone(tmp_path: Path) -> None:
    """Four threads write beside at once: one batch at a time goes to the helper, the
    others are written alone; every answer is right."""
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for r in range(10):
                _write_beside(tmp_path / f"w{n}-{r}", [os.urandom(512 << 10) for _ in range(3)])
        except BaseException as exc:  # reported below, from the test's thread
            errors.append(exc)

    before = _stats()
    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert 0 < _stats().posted - before.posted <= 40


def test_a_failed_write_lets_the_helper_go(tmp_path: Path) -> None:
    """The kernel refuses the writes (a read-only descriptor): the call raises, and the
    helper is free for the next batch, which is right."""
    import errno

    (tmp_path / "ro").write_bytes(b"x")
    values = [os.urandom(VALUE) for _ in range(3)]
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            rowcopy.frame_write_many(fd, _items(values), beside=True)
        assert err.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert (tmp_path / "ro").read_bytes() == b"x"
    posted = _stats().posted
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for _ in range(50):  # the helper may still be looking over the failed batch
            got = rowcopy.frame_write_many(fd, _items(values), beside=True)
            assert got == _want(values)
            if _stats().posted > posted:
                break
    finally:
        os.close(fd)
    assert _stats().posted > posted
    _check_file(tmp_path / "seg", values, got)


def test_a_forked_child_starts_its_own_helper(tmp_path: Path) -> None:
    """A child forked after the helper started has none (threads do not survive a fork):
    it starts its own on its first batch, counts from zero, and writes right."""
    fd = os.open(tmp_path / "parent", os.O_RDWR | os.O_CREAT, 0o600)
    values = [os.urandom(VALUE) for _ in range(2)]
    try:
        assert rowcopy.frame_write_many(fd, _items(values), beside=True) == _want(values)
    finally:
        os.close(fd)
    assert _stats().running
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            fresh = rowcopy.hash_helper_stats()
            path = tmp_path / "child"
            cfd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            got = rowcopy.frame_write_many(cfd, _items(values), beside=True)
            os.close(cfd)
            after = rowcopy.hash_helper_stats()
            _check_file(path, values, _want(values))
            if (
                fresh is not None and after is not None and got == _want(values)
                and fresh == (0, 0, 0, False) and after.posted == 1 and after.running
            ):  # fmt: skip
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_disk_only_store_puts_beside_the_helper(tmp_path: Path) -> None:
    """A store with a disk tier alone hashes its puts on the helper and reads back what
    was put; a two-tier store's disk tier (spills, writes around) does not."""
    disk_only = LocalStore(tmp_path / "a", 256 << 20, memory_bytes=0, value_bytes=VALUE)
    two = LocalStore(
        tmp_path / "b", 256 << 20, memory_bytes=64 << 20, memory_path=tmp_path / "shm",
        value_bytes=VALUE,
    )  # fmt: skip
    try:
        assert disk_only.disk.hash_beside and not two.disk.hash_beside
        before = _stats()
        values = {f"v/{i}": os.urandom(VALUE) for i in range(8)}
        items = list(values.items())
        for i in range(0, len(items), 2):
            assert disk_only.put_many(items[i : i + 2]) == [True, True]
        assert _stats().posted > before.posted
        assert disk_only.get_many(list(values)) == list(values.values())
        for key, value in values.items():
            loc = disk_only.where(key)
            assert loc is not None and loc.tier == "disk"
            with open(os.path.join(disk_only.disk.path, loc.file), "rb") as f:
                f.seek(loc.offset - framing.HEADER_SIZE)
                assert f.read(framing.HEADER_SIZE) == framing.make_header(
                    key.encode(), memoryview(value)
                )
    finally:
        disk_only.close()
        two.close()
