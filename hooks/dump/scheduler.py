"""DumpScheduler: one per worker process, shared by every KV-connector instance in it.

The forward pass hands each layer's (or storage row's) dump over and moves on; a bounded
pool of worker threads waits for the dump's event, produces the bytes and puts them into
the store, so the forward thread never waits on store I/O. Each connector keeps its
requests in its own :class:`DumpClient`; the threads, task slots, event ledger, device and
metrics are the process's. docs/DUMPS.md explains back-pressure, completion, preemption,
delayed free and the locking.

Locking, in brief: the per-layer submit takes no lock (a slot pop is atomic; it counts
into the batch's and its client's single-writer counters, folded into the metrics under
the lock when tasks are retired or metrics read). ``_lock`` guards batch completion, slot
returns, the metrics and the event ledger's counters, and is never held while waiting.
Each client guards its own request maps with its own lock, a leaf: the scheduler tells it
of a completed batch by appending to the client's queue (:meth:`DumpClient.batch_done`),
and a client calls the scheduler only with its lock released. Workers never wait for
``_lock``: they hand finished tasks back on a deque, retired under ``_lock`` by whoever
holds it next. ``_done_cv`` (taken before ``_lock``, never after) wakes threads waiting
for dumps; ``_wake`` parks idle workers. Lock order: ``_done_cv``, ``_lock``, a client's.

Exit: dumps still in flight when the process exits get a bounded flush
(:data:`EXIT_FLUSH_VAR`, default :data:`DEFAULT_EXIT_FLUSH_S` seconds, or the connector's
``dump_exit_flush_s``) so a clean shutdown does not throw away the last steps' KV, and a
hung store cannot hold the exit for longer than that; whatever is left is counted in
``lost_dumps`` and logged once with the requests it belonged to.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from time import monotonic, sleep
from typing import Any

from ucm_patch import environment
from ucm_patch.hooks.device import Device
from ucm_patch.hooks.device_choice import make_device
from ucm_patch.hooks.dump.client import DumpClient
from ucm_patch.hooks.dump.types import (
    CANCELLED,
    FAILED,
    NO_EVENT,
    OK,
    STORE_FULL,
    UNEXPECTED,
    Batch,
    DumpTask,
    Payload,
)
from ucm_patch.hooks.events import EventLedger, EventSource
from ucm_patch.hooks.metrics import DURATION_SAMPLES_MAX, METRICS, DumpMetrics
from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import StoreError

logger = logging.getLogger(__name__)

#: Environment setting: seconds the exit flush waits for dumps in flight (declared, read and
#: parsed by :mod:`ucm_patch.environment`).
EXIT_FLUSH_VAR = environment.DUMP_EXIT_FLUSH_S
DEFAULT_EXIT_FLUSH_S = 10.0
#: A failing store fails every row of every step: one warning per cause per this interval.
FAILURE_LOG_INTERVAL_S = 60.0
#: Most request ids named in the "lost at shutdown" line (the count is always exact).
LOST_IDS_SHOWN = 32


def exit_flush_seconds(env: dict[str, str] | None = None) -> float:
    """The exit flush bound from :data:`EXIT_FLUSH_VAR` (unset or empty: the default).

    Asked when a scheduler is created, so a bad value fails at start, naming the variable
    (a :class:`~ucm_patch.errors.ConfigError`, a ``ValueError``). ``env``: a mapping to read
    instead of this process's environment (tests)."""
    seconds = environment.read(env).dump_exit_flush_s
    return DEFAULT_EXIT_FLUSH_S if seconds is None else seconds


#: Most dumps one worker takes at once (:meth:`DumpScheduler._work`): its share of those
#: queued, at most this many.
GROUP_MAX = 64


def _give_back(data: Any) -> None:
    """Give a payload in a lent buffer (the connector's staging buffers) back."""
    release = getattr(data, "release", None)
    if release is not None:
        release()


_SYNC = int(EventSource.DEVICE_SYNC)
_EXTERNAL = int(EventSource.EXTERNAL)


class DumpScheduler:
    """Asynchronous, bounded dump execution; per-request completion lives in the clients.

    Connectors: :meth:`client` (one each), ``submit_layer`` / ``submit`` / ``seal`` (also
    bound on every client), ``has_pending``, ``poll``, ``internal_sizes``, ``shutdown``,
    ``events`` (owned events for ``submit``) and ``metrics``. Clients build on
    :class:`~ucm_patch.hooks.dump.client.SchedulerOfClient`'s methods.

    Options: ``device`` (default: the platform's, :func:`make_device`); ``workers`` dump
    threads; ``capacity`` task slots = most dumps in flight; ``on_full`` / ``full_wait_s``
    the back-pressure policy; ``blocking_finish`` a ``get_finished`` that waits for dumps;
    ``expect_kv_ready`` count "expected but missing" KV-ready events; ``need_handle`` only
    accept events with a raw handle (C++ stores); ``metrics`` the counters object;
    ``linger_s`` / ``poll_s`` how long an idle worker polls before it sleeps (polling
    workers need no wake-up syscall from the forward thread).
    """

    def __init__(
        self,
        device: Device | None = None,
        *,
        workers: int = 2,
        capacity: int = 1024,
        on_full: str = "skip",
        full_wait_s: float = 0.002,
        blocking_finish: bool = False,
        expect_kv_ready: bool = False,
        need_handle: bool = False,
        metrics: DumpMetrics | None = None,
        name: str = "ucm-dump",
        linger_s: float = 0.002,
        poll_s: float = 0.0002,
    ) -> None:
        if workers < 1:
            raise ValueError(f"DumpScheduler workers must be >= 1, got workers={workers!r}")
        if capacity < 1:
            raise ValueError(f"DumpScheduler capacity must be >= 1, got capacity={capacity!r}")
        if on_full not in ("skip", "wait"):
            raise ValueError(f"DumpScheduler on_full={on_full!r}; expected 'skip' or 'wait'")
        if full_wait_s < 0:
            raise ValueError(f"DumpScheduler full_wait_s must be >= 0, got {full_wait_s!r}")
        if linger_s < 0 or poll_s <= 0:
            raise ValueError(
                f"DumpScheduler needs linger_s >= 0 and poll_s > 0, got linger_s={linger_s!r}, "
                f"poll_s={poll_s!r}"
            )
        self.config: dict[str, Any] = {
            "device": device,
            "workers": workers,
            "capacity": capacity,
            "on_full": on_full,
            "full_wait_s": full_wait_s,
            "blocking_finish": blocking_finish,
            "expect_kv_ready": expect_kv_ready,
            "need_handle": need_handle,
            "metrics": metrics,
            "name": name,
            "linger_s": linger_s,
            "poll_s": poll_s,
        }
        self.device = make_device() if device is None else device
        self.metrics = DumpMetrics() if metrics is None else metrics
        self._lock = threading.Lock()
        self.events = EventLedger(
            self.device,
            self.metrics,
            expect_kv_ready=expect_kv_ready,
            need_handle=need_handle,
            lock=self._lock,
        )
        self._resolve = self.events.resolve
        self.metrics.live_handles = self.live_handles
        self.metrics.refresh = self.refresh_metrics
        self._count_event = self.events.count_locked
        self.capacity = capacity
        self.on_full_wait = on_full == "wait"
        self.full_wait_s = full_wait_s
        self.blocking_finish = blocking_finish
        self.linger_s = linger_s
        self.poll_s = poll_s
        self._free: list[DumpTask] = [DumpTask() for _ in range(capacity)]
        self._tasks = tuple(self._free)  # every slot, to name what is in flight at shutdown
        #: Seconds the exit flush waits for dumps in flight (see :meth:`set_exit_flush`).
        self.exit_flush_s = exit_flush_seconds()
        self._exit_flush_set = False
        #: Dumps cancelled or still running when :meth:`shutdown` gave up on them.
        self.lost_dumps = 0
        self._failure_log = RateLimitedLog(logger, FAILURE_LOG_INTERVAL_S)
        # Task hand-off: a deque (append/popleft are atomic, no syscall) plus a Condition
        # that only sleeping workers wait on. Waking a blocked thread costs a futex
        # syscall (more than the whole submit path), so submit wakes a worker only when
        # one is asleep; busy or lingering workers poll the deque.
        self._dq: deque[DumpTask] = deque()
        self._wake = threading.Condition(threading.Lock())
        self._sleepers = 0
        self._wake_pending = False  # a notify was sent and no worker consumed it yet
        # Completion hand-back: workers append finished tasks here and never take _lock
        # (a worker holding _lock while the GIL switches away would stall the forward
        # thread for up to a switch interval). The forward side retires them under _lock.
        # _done_cv wakes threads that wait for dumps; workers notify it only when
        # _waiters > 0. Lock order: _done_cv's lock before _lock, never the reverse.
        self._done: deque[DumpTask] = deque()
        self._done_cv = threading.Condition(threading.Lock())
        self._batches_live = 0
        self._waiters = 0
        self._closed = False
        self._clients: list[DumpClient] = []
        #: The last few unexpected worker errors (repr), newest last; also logged.
        self.last_errors: deque[str] = deque(maxlen=16)
        # Workers past their event wait (metrics.dump_busy_s); only workers take this lock.
        self._busy_lock = threading.Lock()
        self._busy_workers = 0
        self._busy_since = 0.0
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # =================================================================================
    # Clients (one per connector instance)
    # =================================================================================
    def client(self, name: str = "connector") -> DumpClient:
        """A new request-id space on this scheduler (one per connector instance)."""
        client = DumpClient(self, name)
        with self._lock:
            if self._closed:
                raise RuntimeError("DumpScheduler.client: the scheduler is shut down")
            self._clients.append(client)
        return client

    def has_pending(self) -> bool:
        """True while any dump runs or any client has finished requests not yet reported."""
        with self._lock:
            self._retire_locked()
            if self.metrics.queue_depth:
                return True
            clients = list(self._clients)
        return any(c.reports_pending() for c in clients)

    # What clients build on (client.SchedulerOfClient): each takes _lock itself; a client
    # calls them with its own lock released.
    def batch_opened(self) -> None:
        """A client opened a batch: it counts as live until it completes. RuntimeError
        once shut down (the batch would never run)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DumpScheduler: shut down, no batch can be opened")
            self._batches_live += 1

    def requests_reported(self, ready: int, failed: int, waits_ns: list[int]) -> None:
        """A client reported ``ready`` requests (``failed`` of them not fully stored);
        ``waits_ns``: how long each waited for its dumps after it finished."""
        m = self.metrics
        with self._lock:
            m.requests_finished += ready
            m.requests_failed += failed
            for wait in waits_ns:
                m.request_wait.observe(wait / 1e9)

    def preempt_waited(self, seconds: float) -> None:
        """A client waited ``seconds`` for the dumps of preempted requests."""
        with self._lock:
            self.metrics.preempt_wait.observe(seconds)

    def remove_client(self, client: DumpClient) -> None:
        """Forget a closed client: it no longer counts in sizes and pending work."""
        with self._lock:
            if client in self._clients:
                self._fold_client_locked(client)
                self._clients.remove(client)

    def _seal_locked(self, batch: Batch) -> None:
        """:meth:`seal` for a caller that holds the lock.

        Sealing runs on the submitting thread after its last submit, so ``submitted`` is
        final here; a batch retired to ``submitted`` before the seal completes now."""
        if not batch.sealed:
            batch.sealed = True
            if batch.retired == batch.submitted:
                self._complete_batch(batch)

    def _fold_locked(self) -> None:
        """Add what every client submitted since the last fold to the metrics and the
        event ledger's live counts (lock held). Runs before tasks are retired, so a task
        is always counted live before its release is."""
        for client in self._clients:
            if client.tally != client.folded:  # one C-level compare when nothing changed
                self._fold_client_locked(client)

    def _fold_client_locked(self, client: DumpClient) -> None:
        count = self._count_event
        submitted = 0
        for source, owned, n in client.tally.added(client.folded):
            submitted += n
            count(owned, source, n)
        self.metrics.dumps_submitted += submitted

    def refresh_metrics(self) -> None:
        """Fold pending submit counts into the metrics (their readers call it first)."""
        with self._lock:
            self._fold_locked()

    def live_handles(self) -> tuple[int, int]:
        """(owned, borrowed) events held by tasks, submits not yet folded included."""
        with self._lock:
            self._fold_locked()
            return self.events.live()

    # =================================================================================
    # Save side (forward thread): submit never waits on the store
    # =================================================================================
    def submit_layer(
        self,
        batch: Batch,
        layer_name: str,
        attn_metadata: Any,
        row: int,
        keys: Sequence[str] | None,
        data: Payload,
    ) -> bool:
        """Dump one layer/row, waiting on the layer's resolved event (events.py order).

        The save-side hot path: resolves the event (KV-ready first, then an owned
        current-stream event, then device sync) and queues the dump. Never waits on the
        store. Returns False when the dump was skipped (back-pressure or shut down).
        """
        event, owned, source = self._resolve(layer_name, attn_metadata)
        # _enqueue's first case, inline: this runs once per layer per step, and the call
        # it saves was a third of this method's time (bench_dump_hook.py, issue #28);
        # everything else, back-pressure included, goes through _enqueue.
        if type(batch) is Batch and not batch.sealed and not self._closed:
            free = self._free
            if free:
                try:
                    task = free.pop()
                except IndexError:  # another submitting thread took the last slot
                    pass
                else:
                    batch.submitted += 1
                    batch.tally[owned][source] += 1
                    task.batch = batch
                    task.row = row
                    task.keys = keys
                    task.data = data
                    task.event = event
                    task.owned = owned
                    task.source = source
                    self._dq.append(task)
                    if self._sleepers and not self._wake_pending:
                        self._wake_one()
                    return True
        return self._enqueue(batch, row, keys, data, event, owned, source, True)

    def submit(
        self,
        batch: Batch,
        row: int,
        keys: Sequence[str] | None,
        data: Payload,
        event: Any = None,
        owned: bool = False,
        source: int | None = None,
    ) -> bool:
        """Queue one dump with a caller-chosen event; never waits on store I/O.

        ``event=None``: the payload is host data, nothing to wait for (or pass
        ``source=EventSource.DEVICE_SYNC`` to have the worker synchronise the device
        first). Otherwise the worker waits on ``event``: ``owned=False`` borrows it (it is
        only dropped, never destroyed); ``owned=True`` hands over an event from the device
        pool — get one with ``ev, owned, src = sched.events.record()`` (an owned
        current-stream event, or device sync when recording fails) and pass all three.
        Events given here must not come from ``events.acquire`` (that one counts them for
        callers outside the scheduler). ``submit`` takes the event over whatever happens:
        it is released once even when this returns False (skipped) or raises (TypeError
        for a non-Batch, RuntimeError for a sealed batch).
        """
        if source is None:
            source = NO_EVENT if event is None else _EXTERNAL
        return self._enqueue(batch, row, keys, data, event, owned, source, True)

    def _enqueue(
        self,
        batch: Batch,
        row: int,
        keys: Sequence[str] | None,
        data: Payload,
        event: Any,
        owned: bool,
        source: int,
        may_wait: bool,
    ) -> bool:
        # No lock: list.pop is atomic, and the counters written here have this thread
        # as their only writer (Batch.submitted, the client's tally; see DumpClient).
        task = None
        if type(batch) is Batch and not batch.sealed and not self._closed:
            try:
                task = self._free.pop()
            except IndexError:
                pass
            else:
                batch.submitted += 1
                batch.tally[owned][source] += 1
        if task is None:
            if may_wait and self._wait_for_slot(batch, event, owned):
                return self._enqueue(batch, row, keys, data, event, owned, source, False)
            return self._skip(batch, event, owned)
        task.batch = batch
        task.row = row
        task.keys = keys
        task.data = data
        task.event = event
        task.owned = owned
        task.source = source
        self._dq.append(task)
        if self._sleepers and not self._wake_pending:
            self._wake_one()
        return True

    def _wake_one(self) -> None:
        """Wake one sleeping worker, at most one wake-up in flight (no syscall storm)."""
        wake = self._wake
        with wake:
            if self._sleepers and not self._wake_pending:
                self._wake_pending = True
                wake.notify()

    def _wait_for_slot(self, batch: Batch, event: Any, owned: bool) -> bool:
        """Slow path of a submit. True: a slot may be free now, try once more.

        Raises (after releasing the event) for a non-Batch or a sealed batch.
        """
        if type(batch) is not Batch:
            self.events.release(event, owned, counted=False)
            raise TypeError(
                f"DumpScheduler.submit: batch must come from open_batch(), got "
                f"{type(batch).__name__}"
            )
        if self._closed:
            return False  # shut down: skipped (counted by _skip), never an exception
        if batch.sealed:
            self.events.release(event, owned, counted=False)
            raise RuntimeError(
                f"DumpScheduler.submit: batch of {len(batch.req_ids)} request(s) is sealed; "
                "open a new batch for the next step"
            )
        if not self.on_full_wait or self.full_wait_s <= 0:
            with self._lock:  # finished dumps not yet retired may free a slot
                self._retire_locked()
                return bool(self._free)
        return self.wait_until(lambda: bool(self._free) or self._closed, self.full_wait_s) and (
            not self._closed
        )

    def _skip(self, batch: Batch, event: Any, owned: bool) -> bool:
        """Back-pressure / shut down: count, mark the batch failed, release the event.
        Back-pressure is said too, once per minute (a slow path: the queue was full)."""
        lock = self._lock
        lock.acquire()
        try:
            self.metrics.dumps_skipped += 1
            batch.failed = True
            if event is not None:
                self.events.release_locked(event, owned, counted=False)
        finally:
            lock.release()
        if not self._closed:
            self._failure_log.warning(
                "queue full",
                "dump queue full (%d dumps in flight, on_full=%s): dumps skipped, their "
                "requests are not stored (the connector's dump_queue_capacity, dump_workers, "
                "dump_on_full and dump_full_wait_s)",
                self.capacity,
                "wait" if self.on_full_wait else "skip",
            )
        return False

    def seal(self, batch: Batch) -> None:
        """No more dumps for ``batch`` (call from ``wait_for_save``). Never waits."""
        with self._lock:
            self._seal_locked(batch)

    # =================================================================================
    # Queries
    # =================================================================================
    def poll(self) -> None:
        """Retire finished dumps now (metrics, slots, events); ``get_finished`` does this too.

        Metrics and ``queue_depth`` are updated when finished dumps are retired, i.e. at
        the latest on the next ``get_finished`` / ``has_pending`` / ``internal_sizes``.
        """
        with self._lock:
            self._retire_locked()

    def internal_sizes(self) -> dict[str, int]:
        """Sizes of every internal map/set/queue (all 0 when idle and nothing is tracked).

        Request maps are summed over all clients.
        """
        with self._lock:
            self._retire_locked()
            sizes = {"requests": 0, "ready": 0, "finished_waiting": 0}
            for client in self._clients:
                for key, value in client.sizes().items():
                    sizes[key] += value
            sizes["batches"] = self._batches_live
            sizes["slots_in_use"] = self.capacity - len(self._free)
            sizes["queued"] = len(self._dq)
            sizes["unretired"] = len(self._done)
            sizes["waiters"] = self._waiters
        owned, borrowed = self.events.live()
        sizes["live_owned_handles"] = owned
        sizes["live_borrowed_handles"] = borrowed
        return sizes

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
        logger.warning(
            "dump scheduler shut down with %d dump(s) lost (%d still running, %d cancelled)%s;"
            " their blocks are not stored, for request(s) %s%s",
            lost,
            running,
            lost - running,
            f" after a {waited:g} s flush" if waited else "",
            shown,
            more,
        )

    # =================================================================================
    # Workers
    # =================================================================================
    def _work(self) -> None:
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
            # round of store calls instead of one per row.
            group = [task]
            more = min(GROUP_MAX, -(-(len(dq) + 1) // workers)) - 1
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
        logger.error("unexpected error in dump worker (row %d)", task.row, exc_info=exc)
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

    def _retire_locked(self) -> None:
        """Retire every finished task (caller holds _lock): the completion bookkeeping.

        Releases the task's event, updates metrics and its batch, returns the slot. Runs on
        the forward side (get_finished, waits, slow submit paths), per step, not per layer.
        """
        self._fold_locked()
        done = self._done
        m = self.metrics
        free = self._free
        depth = self.capacity - len(free)
        if depth > m.queue_depth_max:
            m.queue_depth_max = depth
        if not done:
            m.queue_depth = depth
            return
        release = self.events.release_locked
        while True:
            try:
                task = done.popleft()
            except IndexError:
                break
            event = task.event
            if event is not None:
                task.event = None
                release(event, task.owned)
            status = task.status
            if status == OK:
                m.dumps_completed += 1
                m.bytes_written += task.nbytes
                m.dump_duration.observe(task.duration)
                m.dump_event_wait_s += task.event_wait
                m.dump_produce_s += task.produce
                if len(m.dump_durations) < DURATION_SAMPLES_MAX:
                    m.dump_durations.append(task.duration)
            elif status == CANCELLED:
                m.dumps_cancelled += 1
            else:
                m.dumps_failed += 1
                if status == STORE_FULL:
                    m.dumps_store_full += 1
                elif status == UNEXPECTED:
                    m.worker_errors += 1
                    self.last_errors.append(task.error)
            batch = task.batch
            task.batch = None
            task.keys = None
            task.data = None
            task.error = ""
            task.nbytes = 0
            task.duration = 0.0
            task.event_wait = 0.0
            task.produce = 0.0
            if batch is not None:
                if status != OK:
                    batch.failed = True
                batch.retired += 1
                if batch.sealed and batch.retired == batch.submitted:
                    self._complete_batch(batch)
            free.append(task)
        m.queue_depth = self.capacity - len(free)

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Block (not holding _lock) until ``predicate()`` — evaluated under _lock right
        after retiring finished tasks — is true, or ``timeout`` passed (then False)."""
        deadline = None if timeout is None else monotonic() + timeout
        cv = self._done_cv
        with cv:
            self._waiters += 1
            try:
                while True:
                    with self._lock:
                        self._retire_locked()
                        if predicate():
                            return True
                    if deadline is None:
                        cv.wait()
                    else:
                        remaining = deadline - monotonic()
                        if remaining <= 0:
                            return False
                        cv.wait(remaining)
            finally:
                self._waiters -= 1

    # =================================================================================
    # Bookkeeping (lock held)
    # =================================================================================
    def _complete_batch(self, batch: Batch) -> None:
        batch.done = True
        self._batches_live -= 1
        batch.client.batch_done(batch)


# =====================================================================================
# Per-worker singleton
# =====================================================================================
_instance: DumpScheduler | None = None
_instance_pid = 0
_singleton_lock = threading.Lock()
_atexit_registered = False


def get_scheduler(**config: Any) -> DumpScheduler:
    """This process's DumpScheduler, created on first use with ``config``.

    Every connector instance in the process gets the same object (and should take its own
    :meth:`DumpScheduler.client`). A later call may repeat the config; a *different* value
    for a key raises ValueError naming the key (two connectors asking for incompatible
    schedulers is a configuration error). After a fork the child gets a fresh scheduler
    (threads do not survive fork). Without ``device`` the platform's device is used;
    metrics default to the process-wide ``METRICS`` (the one :func:`metrics.export` shows).
    """
    global _instance, _instance_pid, _atexit_registered
    with _singleton_lock:
        inst = _instance
        if inst is not None and _instance_pid == os.getpid() and not inst.closed:
            for key, value in config.items():
                if key not in inst.config:
                    raise TypeError(f"get_scheduler: unknown option {key!r}")
                current = inst.config[key]
                if key in ("device", "metrics"):
                    differs = value is not None and value is not current
                else:
                    differs = value != current
                if differs:
                    raise ValueError(
                        f"get_scheduler: {key}={value!r} differs from the running "
                        f"scheduler's {key}={current!r}"
                    )
            return inst
        config.setdefault("metrics", METRICS)
        inst = DumpScheduler(**config)
        _instance = inst
        _instance_pid = os.getpid()
        if not _atexit_registered:
            atexit.register(shutdown_at_exit)
            _atexit_registered = True
        return inst


def reset_scheduler(timeout: float = 5.0, flush_s: float = 0.0) -> None:
    """Shut the singleton down and forget it (tests; exit). ``flush_s``: see
    :meth:`DumpScheduler.shutdown`."""
    global _instance
    with _singleton_lock:
        inst, _instance = _instance, None
    if inst is not None and _instance_pid == os.getpid():
        inst.shutdown(timeout, flush_s)


#: After the exit flush the join only lets idle workers go: a dump still running then is
#: stuck in its store and is counted lost (the workers are daemon threads).
EXIT_JOIN_S = 0.2


def shutdown_at_exit() -> None:
    """The exit flush, then shutdown (registered with ``atexit``; idempotent).

    A component that closes stores at exit calls it first: ``atexit`` runs handlers in
    reverse registration order, and a store closed before the flush would fail every dump
    still in flight."""
    with _singleton_lock:
        inst = _instance
    flush_s = inst.exit_flush_s if inst is not None else 0.0
    reset_scheduler(timeout=EXIT_JOIN_S, flush_s=flush_s)
