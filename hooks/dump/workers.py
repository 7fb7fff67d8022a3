"""The dump scheduler's worker threads (:class:`SchedulerWorkers`, a part of
:class:`~.scheduler.DumpScheduler`): each takes queued dumps, waits for their events,
produces their bytes and puts them into their store, off the forward thread, and hands
every task back on the done deque, never waiting for the scheduler's lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from time import monotonic, sleep
from typing import Any

from ucm_patch.hooks.device import Device
from ucm_patch.hooks.dump.lifecycle import scheduler_log
from ucm_patch.hooks.dump.types import FAILED, OK, STORE_FULL, UNEXPECTED, DumpTask
from ucm_patch.hooks.events import EventSource
from ucm_patch.hooks.metrics import DumpMetrics
from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError
from ucm_patch.hooks.stores.publish_channel import beside_forward

#: A failing store fails every row of every step: one warning per cause per this interval.
FAILURE_LOG_INTERVAL_S = 60.0

#: Most dumps one worker takes at once (:meth:`SchedulerWorkers._work`): its share of those
#: queued, at most this many.
GROUP_MAX = 64

_SYNC = int(EventSource.DEVICE_SYNC)


def _give_back(data: Any) -> None:
    """Give a payload in a lent buffer (the connector's staging buffers) back."""
    release = getattr(data, "release", None)
    if release is not None:
        release()


class SchedulerWorkers:
    """The worker loop of a :class:`~.scheduler.DumpScheduler`: its state (below) is set up
    by the scheduler's ``__init__``, and the lock order is the scheduler's."""

    config: dict[str, Any]
    device: Device
    metrics: DumpMetrics
    linger_s: float
    poll_s: float
    _lock: threading.Lock
    _wake: threading.Condition
    _done_cv: threading.Condition
    _busy_lock: threading.Lock
    _dq: deque[DumpTask]
    _done: deque[DumpTask]
    _failure_log: RateLimitedLog
    _sleepers: int
    _wake_pending: bool
    _waiters: int
    _closed: bool
    _busy_workers: int
    _busy_since: float

    def _work(self) -> None:
        # The forward runs beside (vLLM's model runner): this thread's memory tier
        # publishes go through the cleaner process, not py-lmdb calls that each give the
        # GIL up here (.publish_channel).
        beside_forward()
        popleft = self._dq.popleft
        dq = self._dq
        workers = self.config["workers"]
        while True:
            try:
                task = popleft()
            except IndexError:
                if self._idle():
                    return
                continue
            # The rows queued meanwhile, this worker's share of them, go with it: one put
            # for all (:meth:`_run_group`). A worker that waited for the GIL (beside
            # vLLM's forward, up to the switch interval per take) catches up with one
            # round of store calls instead of one per row. The share is of the workers
            # not at work now (a racy read is fine: it only sizes the group): split over
            # all of them while one was busy, the rest came in a second put behind it.
            group = [task]
            free = max(1, workers - self._busy_workers)
            more = min(GROUP_MAX, -(-(len(dq) + 1) // free)) - 1
            while more > 0:
                try:
                    group.append(popleft())
                except IndexError:
                    break
                more -= 1
            self._run_group(group)

    def _run_group(self, group: list[DumpTask]) -> None:
        """Wait for each task's event and produce its bytes, then put the values of every
        task with the same store in one ``put_many`` (one native copy and one index
        transaction per segment, however many rows). Every task is handed back, whatever
        happens: a task's own failure (its event, its payload) fails it alone, a store's
        fails the tasks of that put."""
        started = monotonic()  # worker thread: off the forward path
        left = list(group)
        try:
            ready: list[tuple[DumpTask, Sequence[str], Sequence[Any]]] = []
            for task in group:
                try:
                    keys, data = self._prepare(task)
                except Exception as exc:
                    left.remove(task)
                    self._finish(task, self._failed(task, exc), started)
                    continue
                ready.append((task, keys, data))
            i = 0
            while i < len(ready):
                store = ready[i][0].batch.store
                j = i + 1
                while j < len(ready) and ready[j][0].batch.store is store:
                    j += 1
                part = ready[i:j]
                statuses = self._put_part(part, store)
                for (task, _keys, _data), status in zip(part, statuses, strict=True):
                    left.remove(task)
                    self._finish(task, status, started)
                i = j
        finally:
            for task in left:  # BaseException: handed back all the same (FAILED)
                self._finish(task, FAILED, started)

    def _finish(self, task: DumpTask, status: int, started: float) -> None:
        """Hand ``task`` back: retired under _lock here when the lock is free (never
        waiting for it), else by whoever takes it next."""
        task.duration = monotonic() - started
        task.status = status
        self._done.append(task)
        lock = self._lock
        if lock.acquire(False):
            try:
                self._retire_locked()
            finally:
                lock.release()
        if self._waiters:
            self._notify_done()

    def _failed(self, task: DumpTask, exc: Exception) -> int:
        """The status of ``task`` failed by ``exc``, logged (once per cause a minute)."""
        if isinstance(exc, StoreError):
            # A full disk fails every row of every step: one line per cause a minute.
            why = "dump of row %d failed in the store: %s"
            cause = (type(exc), getattr(exc, "errno", None))
            self._failure_log.warning(cause, why, task.row, exc)
            return FAILED
        if isinstance(exc, (RuntimeError, ValueError, TypeError)):
            # RuntimeError: device/event error (torch raises RuntimeError subclasses);
            # ValueError/TypeError: the payload did not match the keys.
            why = "dump of row %d failed: %s: %s"
            self._failure_log.warning(type(exc), why, task.row, type(exc).__name__, exc)
            return FAILED
        # Thread boundary: a bug in a payload callable or a store must neither kill the
        # worker (requests would never finish; blocks would leak) nor vanish. Recorded as
        # worker_errors + a failed dump + last_errors, and logged.
        task.error = repr(exc)
        scheduler_log.error("unexpected error in dump worker (row %d)", task.row, exc_info=exc)
        return UNEXPECTED

    def _notify_done(self) -> None:
        with self._done_cv:
            self._done_cv.notify_all()

    def _idle(self) -> bool:
        """The deque is empty: linger (poll) a little, then sleep. True: shut down."""
        dq = self._dq
        if self.linger_s > 0:
            deadline = monotonic() + self.linger_s
            while not dq and not self._closed and monotonic() < deadline:
                sleep(self.poll_s)  # releases the GIL
            if dq:
                return False
        wake = self._wake
        with wake:
            # Announce sleeping *before* the final emptiness check: a submit that
            # appended just before sees _sleepers > 0 and notifies.
            self._sleepers += 1
            try:
                while not dq and not self._closed:
                    wake.wait()
                    self._wake_pending = False  # consumed; the next submit may wake again
            finally:
                self._sleepers -= 1
            if len(dq) > 1 and self._sleepers:
                # More queued than this worker takes at once: wake a sibling too.
                self._wake_pending = True
                wake.notify()
        return self._closed and not dq

    def _prepare(self, task: DumpTask) -> tuple[Sequence[str], Sequence[Any]]:
        """Wait for the task's event and produce its bytes: (keys, values)."""
        event = task.event
        waited = monotonic()
        if event is not None:
            event.synchronize()
        elif task.source == _SYNC:
            self.device.synchronize()
        produced = monotonic()
        task.event_wait = produced - waited
        data = task.data
        if callable(data):
            self._busy(1)
            try:
                data = data(task)
            finally:
                self._busy(-1)
            task.produce = monotonic() - produced  # the device copy, for the connector
        keys = task.keys
        if keys is None:
            keys, data = data
        if len(keys) != len(data):
            _give_back(data)
            raise ValueError(
                f"dump payload for row {task.row} has {len(data)} values for {len(keys)} keys"
            )
        return keys, data

    def _put_part(
        self, part: list[tuple[DumpTask, Sequence[str], Sequence[Any]]], store: Any
    ) -> list[int]:
        """Put every value of ``part`` (tasks of one store): each task's status. A payload
        in a lent buffer (the connector's staging buffers) is given back once the store
        has copied it, stored or not."""
        try:
            return self._put_values(part, store)
        finally:
            for _task, _keys, data in part:
                _give_back(data)

    def _put_values(
        self, part: list[tuple[DumpTask, Sequence[str], Sequence[Any]]], store: Any
    ) -> list[int]:
        """One ``put_many`` of every value of ``part``. When it raises, each task is put
        again alone: the error may be one task's values' (a key the store refuses), and
        the others are then stored and only that dump fails, as with a put per task."""
        items: list[tuple[str, Any]] = []
        for _task, keys, data in part:
            items.extend(zip(keys, data, strict=True))
        self._busy(1)
        try:
            flags = store.put_many(items)
        except Exception as exc:
            if len(part) > 1:
                flags = None
            else:
                return [self._failed(part[0][0], exc)]
        finally:
            self._busy(-1)
        if flags is None:
            return [self._put_values([one], store)[0] for one in part]
        statuses, at = [], 0
        for task, keys, data in part:
            nbytes = 0
            for value in data:
                nbytes += value.nbytes if type(value) is memoryview else len(value)
            task.nbytes = nbytes
            stop = at + len(keys)
            statuses.append(OK if all(flags[at:stop]) else STORE_FULL)
            at = stop
        return statuses

    def _busy(self, change: int) -> None:
        """One worker more (1) or less (-1) at work: the wall time with any at work is
        summed into ``metrics.dump_busy_s``."""
        with self._busy_lock:
            now = monotonic()
            if self._busy_workers == 0:
                self._busy_since = now
            self._busy_workers += change
            if self._busy_workers == 0:
                self.metrics.dump_busy_s += now - self._busy_since


__all__ = ["FAILURE_LOG_INTERVAL_S", "GROUP_MAX", "SchedulerWorkers"]
