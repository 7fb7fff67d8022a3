"""The memory tier allocates and maps its capacity when it opens, off the put path.

Why it matters: on a virtual machine with 4 KiB pages, a put into a fresh tmpfs segment
ran at a fifth of one into a mapped segment (page allocation and faults; the GPU check's
dumps fell behind KV production). These tests prove that the warmer runs in the
background, that a put after it allocates nothing, that another process's store maps what
is there, that close stops it, and that a full file system stops it quietly (the put
path's own ENOSPC handling is tested in test_store_local_diskfull.py).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import remove_tier_dir
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.tier import on_tmpfs

SEG = 1 << 20


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"ucm_patch-warm-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    remove_tier_dir(path)


def _open(tmp_path: Path, shm_dir: Path, segments: int = 8, keep: int = 0) -> LocalStore:
    """``keep``: bytes the tier keeps after its last close (0: spilled and removed)."""
    return LocalStore(
        tmp_path / "kv",
        16 * SEG,
        memory_bytes=segments * SEG,
        memory_path=shm_dir,
        segment_bytes=SEG,
        memory_keep_bytes=keep,
    )


def _is_segment(fd: int) -> bool:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("seg-")


def _warmed(store: LocalStore) -> None:
    assert store.memory is not None and store.memory._warmer is not None
    store.memory._warmer.join(30)
    assert not store.memory._warmer.is_alive()


def test_every_segment_is_allocated_and_mapped_after_open(tmp_path: Path, shm_dir: Path) -> None:
    store = _open(tmp_path, shm_dir)
    try:
        _warmed(store)
        tier = store.memory
        assert tier is not None and tier.count == 8
        assert sorted(tier.files._maps) == list(range(tier.count))  # mapped in this process
        for seg in range(tier.count):
            st = os.stat(shm_dir / f"seg-{seg:05d}")
            assert st.st_size == SEG and st.st_blocks * 512 >= SEG  # allocated, not sparse
        assert store.disk._warmer is None  # the disk tier is written with pwritev
    finally:
        store.close()


def test_a_memory_tier_on_a_disk_is_not_allocated_ahead(tmp_path: Path) -> None:
    """Only a memory file system is worth allocating ahead (tests point the memory tier
    at their temporary directory, on a disk: warming would reserve disk space there)."""
    store = LocalStore(tmp_path / "kv", 16 * SEG, memory_bytes=8 * SEG,
                       memory_path=tmp_path / "mem", segment_bytes=SEG)  # fmt: skip
    try:
        assert on_tmpfs("/dev/shm") and not on_tmpfs(str(tmp_path))
        assert store.memory is not None and store.memory._warmer is None
        assert list((tmp_path / "mem").glob("seg-*")) == []
    finally:
        store.close()


def test_a_put_after_warming_allocates_nothing(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(tmp_path, shm_dir)
    try:
        _warmed(store)
        calls: list[int] = []
        real = os.posix_fallocate
        monkeypatch.setattr(
            os, "posix_fallocate", lambda fd, o, n: (calls.append(n), real(fd, o, n))
        )
        values = [(f"k{i}", bytes([i]) * (200 << 10)) for i in range(20)]  # 4 MiB: 5 segments
        assert store.put_many(values) == [True] * 20
        assert calls == []
        assert store.get_many([k for k, _ in values]) == [v for _, v in values]
        assert store.stats["memory_hits"] == 20 and store.stats["spilled"] == 0
    finally:
        store.close()


def test_another_process_maps_what_is_there(tmp_path: Path, shm_dir: Path) -> None:
    """A second store on the same directories (another process's view: its own mappings)
    warms the segments the first one wrote, and reads the values from them (the tier
    outlives the first store: ``local_memory_keep_bytes``)."""
    first = _open(tmp_path, shm_dir, keep=8 * SEG)
    values = [(f"k{i}", bytes([i + 1]) * (300 << 10)) for i in range(10)]
    try:
        assert first.put_many(values) == [True] * 10
    finally:
        first.close()
    second = _open(tmp_path, shm_dir)
    try:
        _warmed(second)
        assert sorted(second.memory.files._maps) == list(range(8))
        assert second.get_many([k for k, _ in values]) == [v for _, v in values]
    finally:
        second.close()


def test_close_stops_the_warmer(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() while the warmer works: it stops after the segment in hand, and close
    returns with no warmer thread left (nothing maps a segment of a closed store)."""
    gate = threading.Event()
    real = os.posix_fallocate

    def slow(fd: int, offset: int, n: int) -> None:
        if _is_segment(fd):  # the indexes allocate their files too: not held
            gate.wait(5)
        real(fd, offset, n)

    monkeypatch.setattr(os, "posix_fallocate", slow)
    store = _open(tmp_path, shm_dir, segments=64)
    warmer = store.memory._warmer
    assert warmer is not None and warmer.is_alive()
    closer = threading.Thread(target=store.close)
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and not warmer.is_alive()
    assert len(list(shm_dir.glob("seg-*"))) < 64  # stopped, not run to the end


def test_a_full_file_system_stops_the_warmer_quietly(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC at the third segment: the warmer stops there (no exception escapes its
    thread), and puts still land in the segments it did allocate."""
    real = os.posix_fallocate
    seen: list[int] = []

    def full(fd: int, offset: int, n: int) -> None:
        if _is_segment(fd):  # the indexes allocate their files too: not counted
            seen.append(fd)
        if len(seen) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, n)

    monkeypatch.setattr(os, "posix_fallocate", full)
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    store = _open(tmp_path, shm_dir)
    try:
        _warmed(store)
        assert errors == []
        assert sorted(store.memory.files._maps) == [0, 1]
        monkeypatch.setattr(os, "posix_fallocate", real)
        assert store.put_many([("a", b"x" * 1000)]) == [True]
        assert store.get_many(["a"]) == [b"x" * 1000]
    finally:
        store.close()


def test_the_last_quarter_of_the_file_system_is_never_taken_ahead(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/shm is shared with vLLM's and NCCL's buffers: with a quarter of it left, the
    warmer allocates nothing more (segments already allocated are still mapped), and a
    put still takes room on demand. (The first store's tier outlives it: kept.)"""
    first = _open(tmp_path, shm_dir, segments=8, keep=8 * SEG)
    try:
        first.put_many([("a", b"a" * (700 << 10))])  # segment 0 exists, allocated
    finally:
        first.close()
    for seg in range(1, 8):
        (shm_dir / f"seg-{seg:05d}").unlink(missing_ok=True)
    real = os.statvfs

    class Full:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_blocks = st.f_frsize, st.f_blocks
            self.f_bavail = st.f_blocks // 4  # exactly a quarter left

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))
    store = _open(tmp_path, shm_dir, segments=8)
    try:
        _warmed(store)
        assert sorted(store.memory.files._maps) == [0]
        assert sorted(p.name for p in shm_dir.glob("seg-*")) == ["seg-00000"]
        assert store.get_many(["a"]) == [b"a" * (700 << 10)]
        assert store.put_many([("b", b"b" * (700 << 10))]) == [True]
    finally:
        store.close()


def test_scratch_memory_tiers_go_with_the_demo(tmp_path: Path, monkeypatch) -> None:
    """Demos and benchmarks open stores in temporary directories: their default memory
    tiers (allocated in full) are removed when the scratch block ends, env restored."""
    from ucm_patch.hooks.stores.local import default_memory_path, scratch_memory_tiers

    monkeypatch.setenv("XDG_RUNTIME_DIR", "/nonexistent-before")
    with scratch_memory_tiers() as base:
        assert base.startswith("/dev/shm/") and os.environ["XDG_RUNTIME_DIR"] == base
        store = LocalStore(tmp_path / "kv", 16 * SEG, memory_bytes=4 * SEG, segment_bytes=SEG)
        try:
            _warmed(store)
            tier = Path(default_memory_path(str(tmp_path / "kv")))
            assert tier.is_relative_to(base) and len(list(tier.glob("seg-*"))) == 4
        finally:
            store.close()
    assert not Path(base).exists()
    assert os.environ["XDG_RUNTIME_DIR"] == "/nonexistent-before"


def test_a_store_dropped_without_close_stops_warming(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warmer holds its tier weakly: a store nobody references (a tool that forgot
    close()) is collected, and its warmer stops at the next segment."""
    import gc

    gate = threading.Event()
    real = os.posix_fallocate

    def slow(fd: int, offset: int, n: int) -> None:
        if _is_segment(fd):
            gate.wait(5)
            time.sleep(0.02)  # 64 segments take over a second: time for the collector
        real(fd, offset, n)

    monkeypatch.setattr(os, "posix_fallocate", slow)
    store = _open(tmp_path, shm_dir, segments=64)
    warmer = store.memory._warmer
    del store
    gate.set()
    deadline = time.monotonic() + 10
    while warmer.is_alive() and time.monotonic() < deadline:
        gc.collect()  # no cycle holds a store (the tier spills through a weak method)
        time.sleep(0.01)
    assert not warmer.is_alive()
    assert len(list(shm_dir.glob("seg-*"))) < 64
