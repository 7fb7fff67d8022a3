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

The class is in three parts, one job each: this module's queueing and completion, the
worker threads (:mod:`.workers`) and the lifecycle, flush and shutdown with the exit
flush's bound (:mod:`.lifecycle`). The process's one scheduler is
:mod:`.process_scheduler`'s.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

from ucm_patch.hooks.device import Device
from ucm_patch.hooks.device_choice import make_device
from ucm_patch.hooks.dump import keys as dump_keys
from ucm_patch.hooks.dump.client import DumpClient
from ucm_patch.hooks.dump.lifecycle import SchedulerLifecycle, exit_flush_seconds, scheduler_log
from ucm_patch.hooks.dump.types import (
    CANCELLED,
    NO_EVENT,
    OK,
    STORE_FULL,
    UNEXPECTED,
    Batch,
    DumpTask,
    Payload,
)
from ucm_patch.hooks.dump.workers import FAILURE_LOG_INTERVAL_S, SchedulerWorkers
from ucm_patch.hooks.events import EventLedger, EventSource
from ucm_patch.hooks.metrics import DURATION_SAMPLES_MAX, DumpMetrics
from ucm_patch.hooks.ratelimit import RateLimitedLog

_EXTERNAL = int(EventSource.EXTERNAL)


class DumpScheduler(SchedulerWorkers, SchedulerLifecycle):
    """Asynchronous, bounded dump execution; per-request completion lives in the clients.

    Connectors: :meth:`client` (one each), ``submit_layer`` / ``submit`` / ``seal`` (also
    bound on every client), ``has_pending``, ``poll``, ``internal_sizes``, ``shutdown``,
    ``events`` (owned events for ``submit``) and ``metrics``. Clients build on
    :class:`~ucm_patch.hooks.dump.client.SchedulerOfClient`'s methods.

    Options: ``device`` (default: the platform's, :func:`make_device`); ``workers`` dump
    threads; ``capacity`` task slots = most dumps in flight; ``on_full`` / ``full_wait_s``
    the back-pressure policy; ``blocking_finish`` a ``get_finished`` that waits for dumps
    (these five are the connector's ``dump_*`` keys: defaults and checks from
    :data:`~.keys.DUMP_KEYS`, ``workers`` by default :func:`~.keys.copy_threads`);
    ``expect_kv_ready`` count "expected but missing" KV-ready events; ``need_handle`` only
    accept events with a raw handle (C++ stores); ``metrics`` the counters object;
    ``linger_s`` / ``poll_s`` how long an idle worker polls before it sleeps (polling
    workers need no wake-up syscall from the forward thread).
    """

    def __init__(
        self,
        device: Device | None = None,
        *,
        workers: int | None = None,
        capacity: int = dump_keys.default("dump_queue_capacity"),
        on_full: str = dump_keys.default("dump_on_full"),
        full_wait_s: float = dump_keys.default("dump_full_wait_s"),
        blocking_finish: bool = dump_keys.default("blocking_finish"),
        expect_kv_ready: bool = False,
        need_handle: bool = False,
        metrics: DumpMetrics | None = None,
        name: str = "ucm-dump",
        linger_s: float = 0.002,
        poll_s: float = 0.0002,
    ) -> None:
        # the checks of the connector's keys (dump_keys.DUMP_KEYS), one for each
        if workers is None:
            workers = dump_keys.copy_threads()
        workers = dump_keys.checked("workers", workers)
        capacity = dump_keys.checked("capacity", capacity)
        on_full = dump_keys.checked("on_full", on_full)
        full_wait_s = dump_keys.checked("full_wait_s", full_wait_s)
        blocking_finish = dump_keys.checked("blocking_finish", blocking_finish)
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
        self._failure_log = RateLimitedLog(scheduler_log, FAILURE_LOG_INTERVAL_S)
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
