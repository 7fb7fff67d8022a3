"""The store's sidecar thread, and the disk tier's put that hashes while its payloads are
written: the call runs on another thread at the same time as the caller, its result and
its exception come back, one sidecar per thread (gone with its thread, replaced after a
fork); without the row helper, a disk batch of large values is written by the sidecar,
reads back, and a failed payload write publishes nothing and leaves the store usable."""

from __future__ import annotations

import errno
import gc
import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ucm_patch.hooks.stores import tier_writes as tier
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.framing import HEADER_SIZE, PIECE
from ucm_patch.hooks.stores.local import LocalStore
from ucm_patch.hooks.stores.segment_files import FileSegments
from ucm_patch.hooks.stores.sidecar import sidecar

NAME = "ucm-store-sidecar"


def _sidecar_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == NAME)


def test_the_call_runs_meanwhile_on_another_thread_and_returns() -> None:
    side = sidecar()
    release = threading.Lock()
    release.acquire()
    ran_on: list[int] = []

    def blocked(x: int) -> int:
        ran_on.append(threading.get_ident())
        assert release.acquire(timeout=10), "the caller never went on while the call ran"
        return x * 2

    side.start(blocked, 21)
    time.sleep(0.01)
    release.release()  # only possible because start() returned while blocked() runs
    assert side.join() == 42
    assert ran_on and ran_on[0] != threading.get_ident()
    assert sidecar() is side  # one per thread, kept


def test_an_exception_of_the_call_is_raised_by_join_and_the_sidecar_still_works() -> None:
    side = sidecar()

    def fail() -> None:
        raise OSError(errno.EIO, "disk said no")

    side.start(fail)
    with pytest.raises(OSError, match="disk said no"):
        side.join()
    side.start(len, b"abc")
    assert side.join() == 3


class _Interrupt(Exception):
    pass


def test_an_interrupted_join_gives_the_sidecar_up_and_the_next_call_gets_a_new_one() -> None:
    side = sidecar()
    release = threading.Lock()
    release.acquire()

    def raise_interrupt(signum: int, frame: object) -> None:
        raise _Interrupt

    old = signal.signal(signal.SIGALRM, raise_interrupt)
    try:
        side.start(release.acquire)  # runs until released below
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(_Interrupt):
            side.join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    fresh = sidecar()
    assert fresh is not side  # the old call still runs on the old sidecar
    fresh.start(int, "5")
    assert fresh.join() == 5
    release.release()  # the old call ends; its completion reaches nobody
    fresh.start(int, "6")
    assert fresh.join() == 6


def test_each_thread_has_its_own_sidecar_which_stops_with_the_thread() -> None:
    mine = sidecar()
    before = _sidecar_threads()
    theirs: list[tuple[object, int]] = []

    def worker() -> None:
        s = sidecar()
        s.start(sum, [1, 2])
        theirs.append((s, s.join()))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert _sidecar_threads() == before + 1  # the worker's, until its locals are dropped
    assert theirs[0][1] == 3 and theirs[0][0] is not mine
    theirs.clear()
    gc.collect()
    deadline = time.monotonic() + 10
    while _sidecar_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _sidecar_threads() <= before, "the dead thread's sidecar thread kept running"


def test_a_forked_child_gets_a_sidecar_of_its_own() -> None:
    parent = sidecar()
    parent.start(int, "1")
    assert parent.join() == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's sidecar thread does not exist here
        try:
            side = sidecar()
            side.start(int, "7")
            os.write(w, b"new" if side is not parent and side.join() == 7 else b"old")
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 16)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"new"


def _large(i: int) -> bytes:
    """A value over PIECE (the hashing-meanwhile path), the same bytes for the same ``i``."""
    return bytes([i % 251]) * PIECE + hashlib.sha256(str(i).encode()).digest() * 128


@pytest.fixture
def no_row_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without a C compiler: the disk tier's puts take the sidecar (with the row
    helper, one native call hashes and writes a batch: tests/test_store_rowcopy.py)."""
    from ucm_patch.hooks.stores import rowcopy

    monkeypatch.setattr(rowcopy, "_helper", None)
    monkeypatch.setattr(rowcopy, "_tried", True)


def test_disk_tier_large_batch_is_written_by_the_sidecar_and_reads_back(
    tmp_path: Path, monkeypatch, no_row_helper: None
) -> None:
    writes: list[tuple[str, int]] = []  # (thread name, bytes) per FileSegments.write
    real = FileSegments.write

    def recording(self, seg, offset, parts):
        writes.append((threading.current_thread().name, sum(len(p) for p in parts)))
        return real(self, seg, offset, parts)

    monkeypatch.setattr(FileSegments, "write", recording)
    s = LocalStore(tmp_path / "kv", 64 << 20, segment_bytes=4 << 20)
    items = [(f"k{i}", _large(i)) for i in range(3)]
    assert s.put_many(items) == [True] * 3
    payload = sum(len(v) for _k, v in items)
    on_sidecar = [n for name, n in writes if name == NAME]
    here = [n for name, n in writes if name != NAME]
    assert len(on_sidecar) == 1 and on_sidecar[0] >= payload, writes
    assert here == [HEADER_SIZE] * 3, writes  # each header after, into its place
    assert s.get_many([k for k, _v in items]) == [v for _k, v in items]
    s.close()
    reopened = LocalStore(tmp_path / "kv", 64 << 20, segment_bytes=4 << 20)
    assert reopened.get_many([k for k, _v in items]) == [v for _k, v in items]
    assert reopened.stats["corrupt"] == 0
    reopened.close()


def test_disk_tier_failed_payload_write_publishes_nothing(
    tmp_path: Path, monkeypatch, no_row_helper: None
) -> None:
    real = FileSegments.write

    def failing_on_sidecar(self, seg, offset, parts):
        if threading.current_thread().name == NAME:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(self, seg, offset, parts)

    s = LocalStore(tmp_path / "kv", 64 << 20, segment_bytes=4 << 20)
    assert s.put_many([("before", _large(1))]) == [True]
    monkeypatch.setattr(FileSegments, "write", failing_on_sidecar)
    with pytest.raises(StoreError, match="injected"):
        s.put_many([("lost", _large(2)), ("lost2", _large(3))])
    monkeypatch.setattr(FileSegments, "write", real)
    assert s.get_many(["lost", "lost2"]) == [None, None]
    assert s.put_many([("after", _large(4))]) == [True]
    assert s.get_many(["before", "after"]) == [_large(1), _large(4)]
    assert s.stats["errors"] == 1 and s.stats["corrupt"] == 0, s.stats
    s.close()


def test_memory_tier_copies_large_values_on_the_sidecar(
    tmp_path: Path, monkeypatch, no_row_helper: None
) -> None:
    """Without the row helper, from MAPPED_SIDECAR_MIN on, a mapped segment's values are
    copied on the sidecar; smaller ones keep the fused copy (each piece hashed right after
    its copy)."""
    copied_on: list[str] = []
    real = tier._copy_each

    def recording(copies):
        copied_on.append(threading.current_thread().name)
        return real(copies)

    monkeypatch.setattr(tier, "_copy_each", recording)
    s = LocalStore(tmp_path / "kv", 64 << 20, memory_bytes=32 << 20,
                   memory_path=tmp_path / "shm", segment_bytes=8 << 20)  # fmt: skip
    big = [(f"big{i}", _large(i) * 8) for i in range(2)]  # > MAPPED_SIDECAR_MIN each
    assert min(len(v) for _k, v in big) >= tier.MAPPED_SIDECAR_MIN
    small = [("small", _large(9))]
    assert s.put_many(big) == [True, True] and copied_on == [NAME]
    assert s.put_many(small) == [True] and copied_on == [NAME]  # fused: no sidecar
    keys = [k for k, _v in big + small]
    assert s.get_many(keys) == [v for _k, v in big + small]
    assert s.stats["memory_hits"] == 3 and s.stats["corrupt"] == 0, s.stats
    s.close()
