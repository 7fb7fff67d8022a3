"""A memory-tier put's framing on two threads inside one call: the process's copier thread
(``ucm_rowframe`` in hooks/stores/rowcopy.c) takes values of a batch from the same counter
as the caller. Whatever it does (frames values, never begins a batch, is busy with another
caller's, is gone after a fork) every value is framed once: the checksums are xxhash's and
the bytes are the caller's; and a batch too small for a wake-up never reaches it."""

from __future__ import annotations

import os
import threading
import time

import xxhash

from ucm_patch.hooks.stores import rowcopy

VALUE = (1 << 20) + 4096  # more than one frame piece, not a multiple of one
SMALL = 64 << 10


def _stats() -> rowcopy.CopierStats:
    got = rowcopy.copier_stats()
    assert got is not None, "the row helper did not build here (cc and xxhash are present)"
    return got


def _frame(values: list[memoryview]) -> list[bytearray]:
    """``values`` framed into fresh buffers in one call, every digest and byte checked
    against xxhash and the source: the buffers."""
    material = [b"key/%d" % i for i in range(len(values))]
    out = [bytearray(len(v)) for v in values]
    got = rowcopy.frame_many(
        [(memoryview(o), v, m) for o, v, m in zip(out, values, material, strict=True)]
    )
    want = [
        xxhash.xxh3_64_intdigest(v, xxhash.xxh3_64_intdigest(m))
        for v, m in zip(values, material, strict=True)
    ]
    assert got == want
    for i, (o, v) in enumerate(zip(out, values, strict=True)):
        assert o == v, f"value {i} copied wrong"
    return out


def _values(n: int, size: int = VALUE) -> list[memoryview]:
    return [memoryview(os.urandom(size)) for _ in range(n)]


def test_the_copier_frames_values_of_the_callers_batch() -> None:
    """Batches of several values: the copier starts, frames some of them (the host
    schedules it; a busy one delays it, so rounds until it did), and every digest and
    byte is what the caller's thread alone gives."""
    before = _stats()
    values = _values(16)
    for _round in range(100):
        _frame(values)
        if _stats().framed > before.framed:
            break
    after = _stats()
    assert after.running
    assert after.framed > before.framed, f"the copier framed nothing in 100 batches: {after}"
    assert after.posted > before.posted
    # each batch posted was either begun by the copier or taken back unbegun, never lost
    assert after.unstarted - before.unstarted < after.posted - before.posted


def test_a_small_batch_is_framed_by_the_caller_alone() -> None:
    """Below the size a wake-up is worth (or a single value), the copier is not asked."""
    _stats()  # the helper loaded (its self-test shares a batch with the copier)
    before = _stats()
    _frame(_values(4, SMALL))
    _frame(_values(1))
    _frame(_values(4))  # 4 MiB: less than a wake-up is worth
    assert _stats().posted == before.posted


def test_callers_at_once_each_frame_their_own_batch_right() -> None:
    """Four threads framing at once: one batch at a time goes to the copier, the others
    are framed by their callers alone; none waits for another's, all are right."""
    failed: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for _ in range(5):
                _frame(_values(8 + seed))
        except BaseException as exc:  # re-raised on the test's thread
            failed.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    if failed:
        raise failed[0]


def test_a_forked_child_starts_its_own_copier() -> None:
    """A child forked after the copier started has none (threads do not survive a fork):
    it starts its own on its first batch, counts from zero, and frames right."""
    values = _values(8)
    _frame(values)
    assert _stats().running
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            fresh = rowcopy.copier_stats()
            _frame(values)
            after = rowcopy.copier_stats()
            if fresh == (0, 0, 0, False) and after is not None and after.posted == 1:
                code = 0 if after.running else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: thread id -> (name, niceness), from ``/proc/self/task``."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(") ", 1)
        except OSError:
            continue  # ended meanwhile
        out[int(tid)] = (name, int(rest.split()[16]))  # stat's 19th field: nice
    return out


def test_the_copier_runs_at_the_priority_of_the_thread_that_started_it() -> None:
    """The copier shares the cores as the dump threads do (at the lowest priority, beside
    the forward on a host of few cores it got none): its thread, named ucm-copier, runs
    at the niceness of the thread that started it. In a child (its own copier) whose
    thread is at niceness 3 before its first batch: the copier at 3."""
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            os.nice(3)  # this thread's (Linux: niceness is per thread)
            me = threading.get_native_id()
            _frame(_values(8))
            deadline = time.monotonic() + 10
            copiers: list[int] = []
            while not copiers and time.monotonic() < deadline:  # it names itself once up
                threads = _threads()
                copiers = [nice for name, nice in threads.values() if name == "ucm-copier"]
                time.sleep(0.01)
            if rowcopy.copier_stats().running and copiers == [3] and threads[me][1] == 3:
                code = 0
            else:
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
