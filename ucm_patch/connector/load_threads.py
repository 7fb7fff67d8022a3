"""The connector's load threads: a fixed set of daemon threads that can be stopped in bounded time.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined without a bound
twice, in ``shutdown(wait=True)`` and again at interpreter exit (``concurrent.futures``
joins every executor thread before ``atexit`` handlers run). A load stuck in a hung store
would then hold the connector's ``shutdown`` and the process's exit forever. These threads
are daemons; :meth:`LoadThreads.shutdown` cancels queued loads and joins running ones up
to a deadline, and a load still stuck after that cannot keep the process alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from time import monotonic
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class LoadThreads:
    """``workers`` daemon threads running submitted calls; each call returns a Future."""

    def __init__(self, workers: int, name: str = "ucm-load") -> None:
        if workers < 1:
            raise ValueError(f"LoadThreads workers must be >= 1, got workers={workers!r}")
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a load thread. RuntimeError after :meth:`shutdown`."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("ucm connector: load threads are shut down")
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the waiter, never kills the thread
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, timeout: float) -> bool:
        """Cancel queued calls, let running ones end within ``timeout`` seconds.

        Returns False when a thread was still running then (it is a daemon: it cannot
        hold the process's exit, and its Future completes whenever its call returns)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                while not self._queue.empty():
                    job = self._queue.get_nowait()
                    if job is not None:
                        job[0].cancel()
                for _ in self._threads:
                    self._queue.put(None)
        deadline = monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


__all__ = ["LoadThreads"]
