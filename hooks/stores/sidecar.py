"""A second thread per calling thread, for one blocking call at a time.

Why: a disk-tier put is a checksum pass over the payload and a ``pwritev`` that copies it
into the page cache. Both release the GIL (python-xxhash since 3.0, ``os.pwritev`` around
the system call), so they can run at once on two cores; one after the other, the
checksum is a third of the put. The file write starts on the caller's sidecar, the caller
hashes meanwhile, then waits for the write (:meth:`Tier._write`).

Why one sidecar per calling thread, not a pool: the connector's dump workers put at once;
a shared writer thread would queue them behind each other. A sidecar lives as long as its
caller's thread (thread-local; stopped when that thread's locals are dropped) and is
replaced in a forked child, where the thread no longer exists.

Hand-off costs two lock operations each way (``_thread`` locks, no Condition): a few
microseconds against a write of hundreds.
"""

from __future__ import annotations

import _thread
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

_local = threading.local()
_generation = 0  # bumped in a forked child: the parent's sidecar threads are not there


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Slot:
    """What the caller and its sidecar thread share; the thread holds only this (so the
    :class:`Sidecar` can be collected, which stops the thread)."""

    __slots__ = ("done", "go", "job", "outcome")

    def __init__(self) -> None:
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self.outcome: tuple[Any, BaseException | None] = (None, None)


def _serve(slot: _Slot) -> None:
    while True:
        slot.go.acquire()
        job = slot.job
        if job is None:  # stop
            return
        fn, args = job
        try:
            slot.outcome = (fn(*args), None)
        except BaseException as exc:  # handed to the caller's join()
            slot.outcome = (None, exc)
        slot.done.release()


def _stop(slot: _Slot) -> None:
    slot.job = None
    slot.go.release()


class Sidecar:
    """Runs one call at a time on its own thread: :meth:`start`, then :meth:`join`."""

    def __init__(self) -> None:
        self._slot = _Slot()
        self.generation = _generation
        threading.Thread(
            target=_serve, args=(self._slot,), name="ucm-store-sidecar", daemon=True
        ).start()
        weakref.finalize(self, _stop, self._slot)

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the sidecar thread; :meth:`join` must follow."""
        slot = self._slot
        slot.job = (fn, args)
        slot.go.release()

    def join(self) -> Any:
        """Wait for the call :meth:`start` began: its result, or its exception raised here.

        A wait interrupted (a signal's exception in the main thread) leaves the call
        running: this sidecar is then given up (the thread's next :func:`sidecar` starts a
        new one), so no later call can mistake the old call's completion for its own."""
        slot = self._slot
        try:
            slot.done.acquire()
        except BaseException:
            if getattr(_local, "sidecar", None) is self:
                del _local.sidecar
            raise
        (result, error), slot.outcome = slot.outcome, (None, None)  # keep no reference
        if error is not None:
            raise error
        return result


def sidecar() -> Sidecar:
    """The calling thread's sidecar (started on first use, again after a fork)."""
    side: Sidecar | None = getattr(_local, "sidecar", None)
    if side is None or side.generation != _generation:
        side = _local.sidecar = Sidecar()
    return side


__all__ = ["Sidecar", "sidecar"]
