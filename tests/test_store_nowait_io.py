"""Pipe writes and reads that keep the GIL (hooks/stores/nowait_io.py): on a non-blocking
pipe they never wait (a full pipe takes what it can, an empty one gives nothing), the end
of the stream and a bad descriptor are told apart, and a read never runs past its buffer."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from ucm_patch.hooks.stores.nowait_io import read_nowait, write_nowait


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_bytes_written_are_read_back(pipe: tuple[int, int]) -> None:
    r, w = pipe
    buf = ctypes.create_string_buffer(16)
    assert read_nowait(r, buf, 0, 16) == 0  # nothing there: no wait
    assert write_nowait(w, b"abcdef") == 6
    assert read_nowait(r, buf, 2, 4) == 4
    assert read_nowait(r, buf, 6, 10) == 2
    assert buf.raw[2:8] == b"abcdef"


def test_a_full_pipe_takes_what_it_can_and_never_waits(pipe: tuple[int, int]) -> None:
    r, w = pipe
    chunk = bytes(1 << 16)
    total = 0
    t = time.perf_counter()
    while True:
        n = write_nowait(w, chunk)
        total += n
        if n < len(chunk):
            break
    assert write_nowait(w, chunk) == 0  # full
    assert time.perf_counter() - t < 5.0
    buf = ctypes.create_string_buffer(1 << 16)
    drained = 0
    while (got := read_nowait(r, buf, 0, len(buf))) > 0:
        drained += got
    assert drained == total


def test_the_end_of_the_stream_and_a_bad_descriptor(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(w)
    buf = ctypes.create_string_buffer(8)
    assert read_nowait(r, buf, 0, 8) == -1  # the writer closed
    with pytest.raises(OSError) as bad:
        write_nowait(w, b"x")  # closed: EBADF, not a 0 that reads as "full"
    assert bad.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="overrun"):
        read_nowait(r, buf, 4, 5)


def test_a_write_to_a_pipe_nobody_reads_is_an_error(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(r)
    with pytest.raises(OSError) as gone:
        write_nowait(w, b"x")
    assert gone.value.errno == errno.EPIPE


def test_the_gil_is_kept_across_the_call(pipe: tuple[int, int]) -> None:
    """Another thread runs no bytecode during the calls: a counter it bumps in a loop
    does not move while a write and a read run back to back, many times over. The
    control: the same measure sees a foreign call that gives the GIL up (ctypes' CDLL)
    let that thread run, and one through PyDLL (what the module calls through) not."""
    r, w = pipe
    count = 0
    stop = False

    def spin() -> None:
        nonlocal count
        while not stop:
            count += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    buf = ctypes.create_string_buffer(8)
    sleep_released = ctypes.CDLL(None).usleep
    sleep_kept = ctypes.PyDLL(None).usleep

    def moved(call: object, times: int) -> int:
        n = 0
        for _ in range(times):
            before = count
            call()  # type: ignore[operator]
            n += count != before
        return n

    interval = sys.getswitchinterval()
    try:
        time.sleep(0.01)  # the spinner runs, and waits for the GIL from now on
        # no forced switch in the loops' few milliseconds: only a call that gives the GIL
        # up lets the spinner run
        sys.setswitchinterval(1.0)
        time.sleep(0.001)  # a drop asked for under the old interval is served here
        kept = moved(lambda: (write_nowait(w, b"12345678"), read_nowait(r, buf, 0, 8)), 2000)
        kept_sleeping = moved(lambda: sleep_kept(2000), 5)
        sys.setswitchinterval(interval)  # each take back waits up to it: a few calls
        given = moved(lambda: sleep_released(2000), 5)
    finally:
        sys.setswitchinterval(interval)
        stop = True
        t.join()
    assert (kept, kept_sleeping) == (0, 0)
    assert given > 0
