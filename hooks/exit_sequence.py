"""The process's one exit sequence: the dumps in flight flushed first, then the stores
closed, in that order by construction.

A store closed before the dump flush would fail every dump still in flight, so the order
matters; two ``atexit`` handlers would run in reverse registration order, whichever
component happened to register first. Here there is one ``atexit`` handler, and two
phases: every :func:`flush_at_exit` step runs before any :func:`close_at_exit` step,
whatever order they were registered in.

Each step runs once per exit, in its phase in registration order; a step registered
twice runs once. A step that raises is logged and the next one runs: a failing flush
must not leave the stores open, nor a failing close the other stores.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_flushes: list[Callable[[], None]] = []
_closes: list[Callable[[], None]] = []
_registered = False


def flush_at_exit(step: Callable[[], None]) -> None:
    """Run ``step`` at exit before any store closes (the dump scheduler's exit flush)."""
    _add(_flushes, step)


def close_at_exit(step: Callable[[], None]) -> None:
    """Run ``step`` at exit after every flush (closing the stores)."""
    _add(_closes, step)


def _add(phase: list[Callable[[], None]], step: Callable[[], None]) -> None:
    global _registered
    with _lock:
        if step not in phase:
            phase.append(step)
        if not _registered:
            atexit.register(run)
            _registered = True


def run() -> None:
    """The sequence: every flush step, then every close step (the ``atexit`` handler;
    also called directly by tests). Steps stay registered: each is safe to run again."""
    with _lock:
        steps = [*_flushes, *_closes]
    for step in steps:
        try:
            step()
        except Exception:  # the exit goes on: every other step still runs
            log.exception("ucm_patch exit step %s failed", getattr(step, "__qualname__", step))


__all__ = ["close_at_exit", "flush_at_exit", "run"]
