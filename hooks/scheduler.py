"""DumpScheduler: one per worker process, shared by every KV-connector instance in it.

The forward pass hands each layer's (or storage row's) dump to the scheduler and moves on;
a bounded pool of worker threads waits for the dump's event, produces the bytes and puts
them into the store. Requests are reported ``finished_sending`` only once every dump that
reads their blocks is done, so vLLM keeps those blocks allocated until then.

How a worker-side KV connector uses it (the calls vLLM makes, left; ours, right)::

    __init__                         self.dumps = get_scheduler().client()  # own id space
    bind_connector_metadata          batch = self.dumps.open_batch(ids_with_dumps, store, ctx)
    save_kv_layer(layer, kv, md)     row = rows.dump_row(layer)       # -1: not a save layer
                                     if row >= 0:
                                         self.dumps.submit_layer(batch, layer, md, row,
                                                                 keys, produce)
    wait_for_save()                  (whole-model dumps: self.dumps.submit(...) per row)
                                     self.dumps.seal(batch)           # never waits on I/O
    get_finished(finished_ids)       done = self.dumps.get_finished(finished_ids)
                                     return done.sending, None
    handle_preemptions(md)           self.dumps.handle_preemptions(md.preempted_req_ids)
    request_finished(req) (sched.)   return True for every request that had dump blocks in
                                     some step's metadata and was not preempted since (see
                                     "Delayed free" below); in-process: needs_delayed_free()
    has_pending_push_work (sched.)   in-process: self.dumps.has_pending()
    shutdown()                       self.dumps.close()

**Shared vs per connector.** The worker threads, task slots, event ledger, device and
metrics are shared by the whole process (:func:`get_scheduler`). Request bookkeeping is per
:class:`DumpClient` — one per connector instance — because request ids are only unique
within one engine (``LLM`` numbers its requests "0", "1", ...), and vLLM requires each
connector to report only ids it was given. ``DumpScheduler`` itself is also a client (the
default one), so a process with a single connector can call its methods directly.

Per step the connector opens one :class:`Batch` holding the ids of the requests whose blocks
this step's dumps read; per-layer submits then cost O(1) however many requests the step
has (the per-request bookkeeping happens once per step in ``open_batch`` and once per
finished batch on a worker thread).

A dump task carries: its batch (request ids, the store, the connector's per-step context),
the storage row, the keys, the payload and the event to wait on. The payload is either a
sequence of bytes-like values aligned with ``keys`` (already on the host), or a callable
``produce(task)`` run on a worker thread *after* the event completed (e.g. a device->host
copy of ``task.row`` for the blocks in ``task.batch.context``); with ``keys=None`` the
callable returns ``(keys, values)`` itself.

Back-pressure (queue full): the scheduler has ``capacity`` preallocated task slots; a slot
is held from submit until the dump finished, so in-flight dumps are bounded.

* ``on_full="skip"`` (default): submit never blocks. The dump is **skipped**, counted in
  ``dumps_skipped``, and its batch is marked failed, so every request in it comes back in
  :attr:`FinishedDumps.failed` — the connector must not claim those requests' blocks as
  stored (e.g. write no commit record for them). Nothing is dropped silently. Skipping is
  the default because this is a cache: a missing dump costs a later cache miss, a blocked
  forward pass costs every request's latency.
* ``on_full="wait"``: submit blocks the forward thread at most ``full_wait_s`` for a slot,
  then skips as above. The forward pass is slowed by at most
  ``full_wait_s x dumps per step``, never unboundedly.

Completion: by default ``get_finished`` never blocks — a request whose dumps are still
running is reported by a later call (like vLLM's OffloadingConnector). With
``blocking_finish=True`` it waits for the finished requests' dumps inside the call and
reports them in the same step (UCM #989 behaviour, seed 000). A client only reports ids it
was given in one of its ``get_finished`` calls, as vLLM requires.

Preemption: ``handle_preemptions`` waits only for dumps that read the preempted requests'
blocks (other requests' dumps keep running), then forgets those requests.

Delayed free: vLLM's ``request_finished`` runs in the scheduler process. The rule that keeps
both sides consistent: the scheduler side returns True for a request iff its metadata ever
gave that request dump blocks and it was not preempted since; every worker opens batches
from the same metadata, so each worker knows the request and reports it. vLLM frees the
blocks only once *every* worker reported the request, so a worker that dumps nothing for
it (e.g. a TP rank skipping replicated MLA KV) must still open and seal a batch with its
id — an empty batch completes at ``seal``. Ids a worker never saw are ignored by
``get_finished``.

Bounded state: a request leaves every map when it is reported or preempted; batches leave
when their last task finished; task slots are reused. ``internal_sizes`` shows it.

Events: every task owns or borrows its event (:mod:`ucm_patch.hooks.events`); the event is
released exactly once on every path — success, store error, submission error, skip,
preemption, shutdown. ``submit`` takes the event over even when it returns False or raises.

Threads and locking. Workers never *wait* for ``_lock``: they pop tasks from a deque, wait
on the task's event, produce the bytes, call the store, and append the task to a completion
deque (deque operations are atomic). The completion bookkeeping — release the event,
update the batch, the requests and the metrics, return the slot — is ``_reap_locked``,
run under ``_lock`` by the worker right away when a non-blocking ``acquire`` succeeds, and
otherwise by the forward side (``get_finished``, preemption and blocking waits, a submit
that finds no free slot). Why: a worker blocked on a lock the forward thread holds would
queue behind the forward thread's GIL time, and the forward thread must never be the one
waiting for workers on the per-layer path.

* ``_lock`` guards every client's requests, the batches, the slot list, the metrics and
  (shared with the :class:`EventLedger`) the live-handle counters and pool appends. It is
  held for attribute updates only, never while waiting on an event or a store.
* ``_done_cv`` (own lock) wakes threads waiting for dumps (preemption, blocking finish,
  ``on_full="wait"``); workers notify it only when someone waits. Order: ``_done_cv``'s
  lock, then ``_lock``; never the reverse.
* ``_wake`` (own lock) parks and wakes idle workers only.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from time import monotonic, perf_counter_ns, sleep
from typing import Any, NamedTuple

from ucm_patch.hooks.device import Device, make_device
from ucm_patch.hooks.events import EventLedger, EventSource
from ucm_patch.hooks.metrics import METRICS, DumpMetrics
from ucm_patch.hooks.stores.base import KVStore, StoreError

logger = logging.getLogger(__name__)

_NONE = int(EventSource.NONE)
_SYNC = int(EventSource.DEVICE_SYNC)
_EXTERNAL = int(EventSource.EXTERNAL)

# DumpTask.status values.
_OK, _FAILED, _STORE_FULL, _UNEXPECTED, _CANCELLED = range(5)

#: Payload type: host values aligned with keys, or a callable run after the event.
Payload = Sequence[Any] | Callable[["DumpTask"], Any]


class FinishedDumps(NamedTuple):
    """What ``get_finished`` reports for one step."""

    sending: set[str]
    """Requests whose dumps are all done: return as vLLM's ``finished_sending``."""
    failed: set[str]
    """Subset of ``sending`` with at least one failed or skipped dump (not fully stored)."""


class Batch:
    """The dumps of one step for a set of requests (one per connector per step)."""

    __slots__ = ("client", "context", "done", "failed", "pending", "req_ids", "sealed", "store")

    def __init__(
        self, client: DumpClient, req_ids: tuple[str, ...], store: KVStore, context: Any
    ) -> None:
        self.client = client
        self.req_ids = req_ids
        self.store = store
        self.context = context  # opaque to the scheduler: the connector's per-step data
        self.pending = 0  # submitted and not finished
        self.sealed = False  # no more submits (wait_for_save ran)
        self.failed = False  # some dump failed or was skipped
        self.done = False  # sealed and every dump finished


class DumpTask:
    """One dump: a preallocated slot, reused (see the module docstring for the fields).

    A payload callable receives the task and may read ``row``, ``keys`` and
    ``batch.req_ids`` / ``batch.context``; it must not keep a reference to the task (the
    slot is reused for a later dump once this one is retired).
    """

    __slots__ = (
        "batch",
        "data",
        "error",
        "event",
        "keys",
        "nbytes",
        "owned",
        "row",
        "source",
        "status",
    )

    def __init__(self) -> None:
        self.batch: Batch | None = None
        self.row = -1
        self.keys: Sequence[str] | None = None
        self.data: Payload | None = None
        self.event: Any = None
        self.owned = False
        self.source = _NONE
        # Written by the worker before it hands the task back (_work), read by _reap_locked.
        self.status = _OK
        self.nbytes = 0
        self.error = ""


class _Request:
    __slots__ = ("batches", "failed", "finished_ns")

    def __init__(self) -> None:
        self.batches: list[Batch] = []  # open or running batches that read its blocks
        self.failed = False
        self.finished_ns = 0  # when get_finished first saw it (0: still running)


class DumpClient:
    """One connector's view of the shared scheduler: its own request-id space.

    All state is guarded by the scheduler's lock. ``submit``/``submit_layer``/``seal``
    are the scheduler's (a batch knows its client).
    """

    __slots__ = ("_finished_waiting", "_ready", "_reqs", "name", "sched")

    def __init__(self, sched: DumpScheduler, name: str) -> None:
        self.sched = sched
        self.name = name
        self._reqs: dict[str, _Request] = {}
        self._ready: dict[str, bool] = {}  # reportable request id -> failed
        self._finished_waiting = 0  # finished requests with dumps still running

    # -- per step ---------------------------------------------------------------------
    def open_batch(self, req_ids: Iterable[str], store: KVStore, context: Any = None) -> Batch:
        """Start a step's dumps for ``req_ids`` into ``store``; seal it with ``seal``.

        ``req_ids`` are the requests whose blocks this batch's dumps read. Duplicates are
        ignored. Raises ValueError for an id already passed to ``get_finished`` whose dumps
        are still tracked (an id reused too early) and RuntimeError after shutdown.
        """
        ids = tuple(dict.fromkeys(req_ids))
        batch = Batch(self, ids, store, context)
        sched = self.sched
        with sched._lock:
            if sched._closed or self not in sched._clients:
                raise RuntimeError(
                    f"DumpScheduler.open_batch: client {self.name!r} is closed or the "
                    "scheduler is shut down"
                )
            reqs = self._reqs
            for rid in ids:
                req = reqs.get(rid)
                if req is None:
                    req = reqs[rid] = _Request()
                elif req.finished_ns:
                    raise ValueError(
                        f"DumpScheduler.open_batch: request id {rid!r} was already passed to "
                        "get_finished and its dumps are still tracked"
                    )
                req.batches.append(batch)
            sched._batches_live += 1
        return batch

    def submit_layer(
        self,
        batch: Batch,
        layer_name: str,
        attn_metadata: Any,
        row: int,
        keys: Sequence[str] | None,
        data: Payload,
    ) -> bool:
        """See :meth:`DumpScheduler.submit_layer`."""
        return self.sched.submit_layer(batch, layer_name, attn_metadata, row, keys, data)

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
        """See :meth:`DumpScheduler.submit`."""
        return self.sched.submit(batch, row, keys, data, event, owned, source)

    def seal(self, batch: Batch) -> None:
        """See :meth:`DumpScheduler.seal`."""
        self.sched.seal(batch)

    def get_finished(
        self, finished_req_ids: Iterable[str], timeout: float | None = None
    ) -> FinishedDumps:
        """Requests whose dumps are all done, among those ever passed here as finished.

        Default: never blocks; ids whose dumps are running are reported by a later call.
        With ``blocking_finish=True``: waits (up to ``timeout``; None = as long as it takes,
        as seed 000 did) for the dumps of this call's finished requests, then reports them.
        Unknown ids (no dumps registered on this client) are ignored.
        """
        sched = self.sched
        now = perf_counter_ns()
        targets: list[str] = []
        with sched._lock:
            sched._reap_locked()
            reqs = self._reqs
            for rid in finished_req_ids:
                req = reqs.get(rid)
                if req is None or req.finished_ns:
                    continue
                req.finished_ns = now
                if req.batches:
                    self._finished_waiting += 1
                    targets.append(rid)
                else:
                    self._report_ready(rid, req, now)
        if sched.blocking_finish and targets:
            sched._wait_until(lambda: self._drained(targets), timeout)
        with sched._lock:
            if not self._ready:
                return FinishedDumps(set(), set())
            ready, self._ready = self._ready, {}
            failed = {rid for rid, bad in ready.items() if bad}
            sched.metrics.requests_finished += len(ready)
            sched.metrics.requests_failed += len(failed)
        return FinishedDumps(set(ready), failed)

    def handle_preemptions(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Wait for the dumps reading the preempted requests' blocks, then forget them.

        Only dumps that read these requests' blocks are waited for. Call before the
        forward pass that may overwrite the blocks. Returns False if ``timeout`` expired
        first (the requests are forgotten anyway; their dumps keep running).
        """
        sched = self.sched
        t0 = perf_counter_ns()
        with sched._lock:
            targets = [rid for rid in req_ids if rid in self._reqs]
        if not targets:
            return True
        done = sched._wait_until(lambda: self._drained(targets), timeout)
        with sched._lock:
            for rid in targets:
                req = self._reqs.pop(rid, None)
                if req is not None and req.finished_ns and req.batches:
                    self._finished_waiting -= 1
            sched.metrics.preempt_wait.observe((perf_counter_ns() - t0) / 1e9)
        return done

    # -- queries ----------------------------------------------------------------------
    def needs_delayed_free(self, req_id: str) -> bool:
        """True while ``req_id`` has dumps registered here and was not yet reported."""
        with self.sched._lock:
            return req_id in self._reqs or req_id in self._ready

    def has_pending(self) -> bool:
        """True while this client's finished requests wait for dumps or to be reported.

        A connector can return this from vLLM's ``has_pending_push_work`` so the engine
        keeps stepping until held blocks are released (LMCache #4998).
        """
        with self.sched._lock:
            self.sched._reap_locked()
            return bool(self._ready or self._finished_waiting)

    def sizes(self) -> dict[str, int]:
        """This client's map sizes (caller may hold the scheduler lock or not)."""
        return {
            "requests": len(self._reqs),
            "ready": len(self._ready),
            "finished_waiting": self._finished_waiting,
        }

    def close(self) -> None:
        """Forget this client (connector shutdown); its running dumps still finish."""
        sched = self.sched
        with sched._lock:
            for req in self._reqs.values():
                for batch in req.batches:
                    if not batch.sealed:
                        batch.sealed = True
                        if batch.pending == 0:
                            sched._complete_batch(batch)
            self._reqs.clear()
            self._ready.clear()
            self._finished_waiting = 0
            if self in sched._clients:
                sched._clients.remove(self)

    # -- bookkeeping (scheduler lock held) -------------------------------------------
    def _batch_done(self, batch: Batch) -> None:
        reqs = self._reqs
        now = 0
        for rid in batch.req_ids:
            req = reqs.get(rid)
            if req is None:
                continue  # preempted and forgotten
            batches = req.batches
            for i, b in enumerate(batches):
                if b is batch:
                    del batches[i]
                    break
            else:
                continue  # a newer incarnation of the id (resumed after preemption)
            if batch.failed:
                req.failed = True
            if not batches and req.finished_ns:
                if not now:
                    now = perf_counter_ns()
                self._finished_waiting -= 1
                self._report_ready(rid, req, now)

    def _report_ready(self, rid: str, req: _Request, now: int) -> None:
        del self._reqs[rid]
        self._ready[rid] = req.failed
        self.sched.metrics.request_wait.observe((now - req.finished_ns) / 1e9)

    def _drained(self, targets: list[str]) -> bool:
        reqs = self._reqs
        for rid in targets:
            req = reqs.get(rid)
            if req is not None:
                for b in req.batches:
                    if b.pending:
                        return False
        return True


class DumpScheduler:
    """Asynchronous, bounded dump execution with per-request completion (module docstring).

    Also the default :class:`DumpClient` (``open_batch``, ``get_finished``,
    ``handle_preemptions``, ``needs_delayed_free``, ``has_pending`` act on it).

    Options: ``device`` (default: the platform's, :func:`make_device`); ``workers`` dump
    threads; ``capacity`` task slots = most dumps in flight; ``on_full`` / ``full_wait_s``
    the back-pressure policy; ``blocking_finish`` seed 000's waiting ``get_finished``;
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
        self._count_event = self.events.count_locked
        self.capacity = capacity
        self.on_full_wait = on_full == "wait"
        self.full_wait_s = full_wait_s
        self.blocking_finish = blocking_finish
        self.linger_s = linger_s
        self.poll_s = poll_s
        self._free: list[DumpTask] = [DumpTask() for _ in range(capacity)]
        # Task hand-off: a deque (append/popleft are atomic, no syscall) plus a Condition
        # that only sleeping workers wait on. Waking a blocked thread costs a futex
        # syscall (~2-3 us on a VM: more than the whole submit budget), so submit wakes
        # a worker only when one is asleep; busy or lingering workers poll the deque.
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
        self._default = self.client("default")
        #: The last few unexpected worker errors (repr), newest last; also logged.
        self.last_errors: deque[str] = deque(maxlen=16)
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # =================================================================================
    # Clients (one per connector instance) and the default client's methods
    # =================================================================================
    def client(self, name: str = "connector") -> DumpClient:
        """A new request-id space on this scheduler (one per connector instance)."""
        client = DumpClient(self, name)
        with self._lock:
            if self._closed:
                raise RuntimeError("DumpScheduler.client: the scheduler is shut down")
            self._clients.append(client)
        return client

    def open_batch(self, req_ids: Iterable[str], store: KVStore, context: Any = None) -> Batch:
        """:meth:`DumpClient.open_batch` on the default client."""
        return self._default.open_batch(req_ids, store, context)

    def get_finished(
        self, finished_req_ids: Iterable[str], timeout: float | None = None
    ) -> FinishedDumps:
        """:meth:`DumpClient.get_finished` on the default client."""
        return self._default.get_finished(finished_req_ids, timeout)

    def handle_preemptions(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """:meth:`DumpClient.handle_preemptions` on the default client."""
        return self._default.handle_preemptions(req_ids, timeout)

    def needs_delayed_free(self, req_id: str) -> bool:
        """:meth:`DumpClient.needs_delayed_free` on the default client."""
        return self._default.needs_delayed_free(req_id)

    def has_pending(self) -> bool:
        """True while any dump runs or any client has finished requests not yet reported."""
        with self._lock:
            self._reap_locked()
            if self.metrics.queue_depth:
                return True
            return any(c._ready or c._finished_waiting for c in self._clients)

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
            source = _NONE if event is None else _EXTERNAL
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
        lock = self._lock
        free = self._free
        task = None
        lock.acquire()
        try:
            if type(batch) is Batch and free and not batch.sealed and not self._closed:
                task = free.pop()
                batch.pending += 1
                self._count_event(owned, source)
                self.metrics.dumps_submitted += 1
                # queue_depth(_max) are updated at retire time: slots only come back
                # there, so in-flight dumps peak right before a retire.
        finally:
            lock.release()
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
                self._reap_locked()
                return bool(self._free)
        return self._wait_until(lambda: bool(self._free) or self._closed, self.full_wait_s) and (
            not self._closed
        )

    def _skip(self, batch: Batch, event: Any, owned: bool) -> bool:
        """Back-pressure / shut down: count, mark the batch failed, release the event."""
        lock = self._lock
        lock.acquire()
        try:
            self.metrics.dumps_skipped += 1
            batch.failed = True
            if event is not None:
                self.events.release_locked(event, owned, counted=False)
        finally:
            lock.release()
        return False

    def seal(self, batch: Batch) -> None:
        """No more dumps for ``batch`` (call from ``wait_for_save``). Never waits."""
        with self._lock:
            if batch.sealed:
                return
            batch.sealed = True
            if batch.pending == 0:
                self._complete_batch(batch)

    # =================================================================================
    # Queries
    # =================================================================================
    def poll(self) -> None:
        """Retire finished dumps now (metrics, slots, events); ``get_finished`` does this too.

        Metrics and ``queue_depth`` are updated when finished dumps are retired, i.e. at
        the latest on the next ``get_finished`` / ``has_pending`` / ``internal_sizes``.
        """
        with self._lock:
            self._reap_locked()

    def internal_sizes(self) -> dict[str, int]:
        """Sizes of every internal map/set/queue (all 0 when idle and nothing is tracked).

        Request maps are summed over all clients.
        """
        with self._lock:
            self._reap_locked()
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

    # =================================================================================
    # Shutdown
    # =================================================================================
    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop: cancel queued dumps (counted, events released), let running ones finish.

        Open batches are sealed so their requests can still be reported by
        ``get_finished``. Returns False when a worker did not stop within ``timeout`` (it
        is a daemon thread; its running task still releases its event when it ends).
        """
        with self._lock:
            if self._closed:
                return not any(thread.is_alive() for thread in self._threads)
            self._closed = True
        with self._wake:
            self._wake.notify_all()
        with self._done_cv:
            self._done_cv.notify_all()
        while True:
            try:
                task = self._dq.popleft()
            except IndexError:
                break
            task.status = _CANCELLED
            self._done.append(task)
        deadline = monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - monotonic()))
        with self._lock:
            self._reap_locked()
            for client in self._clients:
                for req in client._reqs.values():
                    for batch in req.batches:
                        if not batch.sealed:
                            batch.sealed = True
                            if batch.pending == 0:
                                self._complete_batch(batch)
            self.device.close()  # under the ledger's lock: pool appends happen under it
        return not any(thread.is_alive() for thread in self._threads)

    # =================================================================================
    # Workers
    # =================================================================================
    def _work(self) -> None:
        popleft = self._dq.popleft
        done = self._done
        lock = self._lock
        while True:
            try:
                task = popleft()
            except IndexError:
                if self._idle():
                    return
                continue
            status = _FAILED
            try:
                status = self._run(task)
            except StoreError as exc:
                logger.warning("dump of row %d failed in the store: %s", task.row, exc)
            except (RuntimeError, ValueError, TypeError) as exc:
                # RuntimeError: device/event error (torch raises RuntimeError subclasses);
                # ValueError/TypeError: the payload did not match the keys.
                logger.warning("dump of row %d failed: %s: %s", task.row, type(exc).__name__, exc)
            except Exception as exc:
                # Thread boundary: a bug in a payload callable or a store must neither kill
                # the worker (requests would never finish; blocks would leak) nor vanish.
                # Recorded as worker_errors + a failed dump + last_errors, and logged.
                status = _UNEXPECTED
                task.error = repr(exc)
                logger.exception("unexpected error in dump worker (row %d)", task.row)
            finally:
                task.status = status
                done.append(task)  # hand back: retired under _lock ...
                if lock.acquire(False):  # ... here when the lock is free, never waiting
                    try:
                        self._reap_locked()
                    finally:
                        lock.release()
                if self._waiters:
                    self._notify_done()

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

    def _run(self, task: DumpTask) -> int:
        """Wait for the event, produce the bytes, put them (no scheduler state touched)."""
        event = task.event
        if event is not None:
            event.synchronize()
        elif task.source == _SYNC:
            self.device.synchronize()
        data = task.data
        if callable(data):
            data = data(task)
        keys = task.keys
        if keys is None:
            keys, data = data
        if len(keys) != len(data):
            raise ValueError(
                f"dump payload for row {task.row} has {len(data)} values for {len(keys)} keys"
            )
        flags = task.batch.store.put_many(list(zip(keys, data, strict=True)))
        nbytes = 0
        for value in data:
            nbytes += value.nbytes if type(value) is memoryview else len(value)
        task.nbytes = nbytes
        return _OK if all(flags) else _STORE_FULL

    def _reap_locked(self) -> None:
        """Retire every finished task (caller holds _lock): the completion bookkeeping.

        Releases the task's event, updates metrics and its batch, returns the slot. Runs on
        the forward side (get_finished, waits, slow submit paths), per step, not per layer.
        """
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
            if status == _OK:
                m.dumps_completed += 1
                m.bytes_written += task.nbytes
            elif status == _CANCELLED:
                m.dumps_cancelled += 1
            else:
                m.dumps_failed += 1
                if status == _STORE_FULL:
                    m.dumps_store_full += 1
                elif status == _UNEXPECTED:
                    m.worker_errors += 1
                    self.last_errors.append(task.error)
            batch = task.batch
            task.batch = None
            task.keys = None
            task.data = None
            task.error = ""
            task.nbytes = 0
            if batch is not None:
                if status != _OK:
                    batch.failed = True
                batch.pending -= 1
                if batch.pending == 0 and batch.sealed:
                    self._complete_batch(batch)
            free.append(task)
        m.queue_depth = self.capacity - len(free)

    def _wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Block (not holding _lock) until ``predicate()`` — evaluated under _lock right
        after retiring finished tasks — is true, or ``timeout`` passed."""
        deadline = None if timeout is None else monotonic() + timeout
        cv = self._done_cv
        with cv:
            self._waiters += 1
            try:
                while True:
                    with self._lock:
                        self._reap_locked()
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
        batch.client._batch_done(batch)


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
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        return inst


def reset_scheduler(timeout: float = 5.0) -> None:
    """Shut the singleton down and forget it (tests; connector shutdown)."""
    global _instance
    with _singleton_lock:
        inst, _instance = _instance, None
    if inst is not None and _instance_pid == os.getpid():
        inst.shutdown(timeout)


def _shutdown_at_exit() -> None:
    reset_scheduler(timeout=1.0)
