"""The dump scheduler's lifecycle: its exit-flush bound, flush and shutdown
(:class:`SchedulerLifecycle`, a part of :class:`~.scheduler.DumpScheduler`).

Exit: dumps still in flight when the process exits get a bounded flush
(:data:`EXIT_FLUSH_VAR`, default :data:`DEFAULT_EXIT_FLUSH_S` seconds, or the connector's
``dump_exit_flush_s``) so a clean shutdown does not throw away the last steps' KV, and a
hung store cannot hold the exit for longer than that; whatever is left is counted in
``lost_dumps`` and logged once with the requests it belonged to. The process's one
scheduler and its place in the exit sequence are :mod:`.process_scheduler`'s.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from time import monotonic

from ucm_patch import environment
from ucm_patch.hooks.device import Device
from ucm_patch.hooks.dump import keys as dump_keys
from ucm_patch.hooks.dump.types import CANCELLED, DumpTask
from ucm_patch.hooks.metrics import DumpMetrics

#: The dump scheduler's log, one name for every module of it (what users filter by).
scheduler_log = logging.getLogger("ucm_patch.hooks.dump.scheduler")

#: Environment setting: seconds the exit flush waits for dumps in flight (declared, read and
#: parsed by :mod:`ucm_patch.environment`).
EXIT_FLUSH_VAR = environment.DUMP_EXIT_FLUSH_S
DEFAULT_EXIT_FLUSH_S = dump_keys.DEFAULT_EXIT_FLUSH_S
#: Most request ids named in the "lost at shutdown" line (the count is always exact).
LOST_IDS_SHOWN = 32


def exit_flush_seconds(env: dict[str, str] | None = None) -> float:
    """The exit flush bound from :data:`EXIT_FLUSH_VAR` (unset or empty: the default).

    Asked when a scheduler is created, so a bad value fails at start, naming the variable
    (a :class:`~ucm_patch.errors.ConfigError`, a ``ValueError``). ``env``: a mapping to read
    instead of this process's environment (tests)."""
    seconds = environment.read(env).dump_exit_flush_s
    return DEFAULT_EXIT_FLUSH_S if seconds is None else seconds


class SchedulerLifecycle:
    """Flush and shutdown of a :class:`~.scheduler.DumpScheduler`: its state (below) is
    set up by the scheduler's ``__init__``, and the lock order is the scheduler's."""

    device: Device
    metrics: DumpMetrics
    capacity: int
    exit_flush_s: float
    lost_dumps: int
    _lock: threading.Lock
    _wake: threading.Condition
    _done_cv: threading.Condition
    _dq: deque[DumpTask]
    _done: deque[DumpTask]
    _free: list[DumpTask]
    _tasks: tuple[DumpTask, ...]
    _threads: list[threading.Thread]
    _closed: bool
    _exit_flush_set: bool

    @property
    def closed(self) -> bool:
        return self._closed

    def set_exit_flush(self, seconds: float) -> None:
        """A connector's ``dump_exit_flush_s``: overrides :data:`EXIT_FLUSH_VAR`; when
        several connectors of the process set it, the longest wins (none is cut short)."""
        with self._lock:
            if self._exit_flush_set:
                seconds = max(seconds, self.exit_flush_s)
            self.exit_flush_s = float(seconds)
            self._exit_flush_set = True

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no dump is queued or running."""
        capacity = self.capacity
        return self.wait_until(lambda: len(self._free) == capacity, timeout)

    # =================================================================================
    # Shutdown
    # =================================================================================
    def shutdown(self, timeout: float = 5.0, flush_s: float = 0.0) -> bool:
        """Stop: wait up to ``flush_s`` for dumps in flight, then cancel queued dumps
        (counted, events released) and give running ones ``timeout`` to finish.

        Dumps cancelled or still running at the end are lost: counted in ``lost_dumps``
        and logged once, with how many and whose. Open batches are sealed so their
        requests can still be reported by ``get_finished``. Returns False when a worker
        did not stop within ``timeout`` (it is a daemon thread; its running task still
        releases its event when it ends).
        """
        with self._lock:
            if self._closed:
                return not any(thread.is_alive() for thread in self._threads)
        flushed = flush_s <= 0 or self.flush(flush_s)
        with self._lock:
            self._closed = True
        with self._wake:
            self._wake.notify_all()
        with self._done_cv:
            self._done_cv.notify_all()
        cancelled: list[DumpTask] = []
        while True:
            try:
                task = self._dq.popleft()
            except IndexError:
                break
            task.status = CANCELLED
            cancelled.append(task)
        lost_ids = {rid for task in cancelled if task.batch for rid in task.batch.req_ids}
        self._done.extend(cancelled)
        deadline = monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - monotonic()))
        with self._lock:
            self._retire_locked()
            running = [task for task in self._tasks if task.batch is not None]
            lost_ids.update(rid for task in running for rid in task.batch.req_ids)
            lost = len(cancelled) + len(running)
            self.lost_dumps += lost
            self.metrics.dumps_lost += lost  # exported with the other dump metrics
            for client in self._clients:
                for batch in client.open_batches():  # its lock is a leaf: safe under ours
                    self._seal_locked(batch)
            self.device.close()  # under the ledger's lock: pool appends happen under it
        if lost:
            self._report_lost(lost, len(running), lost_ids, flush_s if not flushed else 0.0)
        return not any(thread.is_alive() for thread in self._threads)

    def _report_lost(self, lost: int, running: int, req_ids: set[str], waited: float) -> None:
        shown = sorted(req_ids)[:LOST_IDS_SHOWN]
        more = f" and {len(req_ids) - len(shown)} more" if len(req_ids) > len(shown) else ""
        scheduler_log.warning(
            "dump scheduler shut down with %d dump(s) lost (%d still running, %d cancelled)%s;"
            " their blocks are not stored, for request(s) %s%s",
            lost,
            running,
            lost - running,
            f" after a {waited:g} s flush" if waited else "",
            shown,
            more,
        )


__all__ = [
    "DEFAULT_EXIT_FLUSH_S",
    "EXIT_FLUSH_VAR",
    "SchedulerLifecycle",
    "exit_flush_seconds",
    "scheduler_log",
]
