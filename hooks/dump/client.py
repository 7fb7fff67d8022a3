"""DumpClient: one connector's request-id space on the shared :class:`DumpScheduler`.

Request ids are unique only within one engine (``LLM`` numbers its requests "0", "1", ...)
and vLLM requires each connector to report only ids it was given, so every connector
instance takes its own client.

Ownership: the client owns its request maps and guards them with its own lock, a leaf
(nothing else is taken while it is held, so the scheduler may take it under its lock).
The scheduler tells a client one thing: a batch of its finished (:meth:`batch_done`, an
append to a queue, from under the scheduler's lock); the client takes those in whenever it
looks at its maps. The client calls the scheduler only with its own lock released, through
the narrow set of :class:`SchedulerOfClient`.

The per-layer submit takes no lock: it counts into the client's ``tally`` (a
:class:`SubmitTally`), written only by the thread that drives the connector (vLLM steps a
connector from one thread), and the scheduler folds the tallies into the shared metrics
under its lock when it retires or when metrics are read (single-writer counters, summed
when read).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any, Protocol

from ucm_patch.hooks.dump.types import Batch, FinishedDumps, SubmitTally
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.hooks.stores.base import KVStore


class SchedulerOfClient(Protocol):
    """What a client uses of the :class:`~ucm_patch.hooks.dump.scheduler.DumpScheduler`
    that made it (listed here so that this module does not import the scheduler, which
    imports this one). Each takes the scheduler's lock itself: a client calls them with
    its own lock released."""

    closed: bool
    blocking_finish: bool
    submit_layer: Callable[..., bool]
    submit: Callable[..., bool]
    seal: Callable[[Batch], None]

    def batch_opened(self) -> None: ...
    def poll(self) -> None: ...
    def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool: ...
    def requests_reported(self, ready: int, failed: int, waits_ns: list[int]) -> None: ...
    def preempt_waited(self, seconds: float) -> None: ...
    def remove_client(self, client: DumpClient) -> None: ...


class _Request:
    __slots__ = ("batches", "failed", "finished_ns")

    def __init__(self) -> None:
        self.batches: list[Batch] = []  # open or running batches that read its blocks
        self.failed = False
        self.finished_ns = 0  # when get_finished first saw it (0: still running)


class DumpClient:
    """One connector's view of the shared scheduler (make it with
    :meth:`DumpScheduler.client`).

    Per step: ``open_batch``, then ``submit_layer`` / ``submit`` per row, then ``seal``;
    these three are the scheduler's own methods, bound here, so the per-layer path costs no
    extra call. Completion: ``get_finished``, ``handle_preemptions``,
    ``needs_delayed_free``, ``has_pending``; ``flush`` and ``close`` at connector shutdown.
    """

    __slots__ = (
        "_closed",
        "_done",
        "_finished_waiting",
        "_lock",
        "_ready",
        "_reqs",
        "_waits_ns",
        "folded",
        "name",
        "scheduler",
        "seal",
        "submit",
        "submit_layer",
        "tally",
    )

    def __init__(self, scheduler: SchedulerOfClient, name: str) -> None:
        self.scheduler = scheduler
        self.name = name
        self._lock = threading.Lock()  # the maps below; a leaf lock (module docstring)
        self._closed = False
        self._reqs: dict[str, _Request] = {}
        self._ready: dict[str, bool] = {}  # reportable request id -> failed
        self._finished_waiting = 0  # finished requests with dumps still running
        self._waits_ns: list[int] = []  # finish-to-ready waits not yet in the metrics
        # Completed batches, appended by the scheduler (deque.append: atomic, no lock).
        self._done: deque[Batch] = deque()
        # Written by this client's submitting thread only; ``folded`` is the part already
        # added to the metrics (scheduler lock).
        self.tally = SubmitTally()
        self.folded = SubmitTally()
        self.submit_layer = scheduler.submit_layer
        self.submit = scheduler.submit
        self.seal = scheduler.seal

    # -- per step ---------------------------------------------------------------------
    def open_batch(self, req_ids: Iterable[str], store: KVStore, context: Any = None) -> Batch:
        """Start a step's dumps for ``req_ids`` into ``store``; seal it with ``seal``.

        ``req_ids`` are the requests whose blocks this batch's dumps read. Duplicates are
        ignored. Raises ValueError for an id already passed to ``get_finished`` whose dumps
        are still tracked (an id reused too early) and RuntimeError after ``close`` or the
        scheduler's shutdown.
        """
        ids = tuple(dict.fromkeys(req_ids))
        batch = Batch(self, ids, store, context)
        with self._lock:
            if self._closed or self.scheduler.closed:
                raise RuntimeError(
                    f"DumpClient.open_batch: client {self.name!r} is closed or the "
                    "scheduler is shut down"
                )
            self._take_done()
            for rid in ids:
                req = self._reqs.get(rid)
                if req is not None and req.finished_ns:
                    raise ValueError(
                        f"DumpClient.open_batch: request id {rid!r} was already passed to "
                        "get_finished and its dumps are still tracked"
                    )
        # Counted live before any request can wait on it (RuntimeError once shut down):
        # a batch is registered here only once the scheduler knows it.
        self.scheduler.batch_opened()
        with self._lock:
            reqs = self._reqs
            for rid in ids:
                req = reqs.get(rid)
                if req is None:
                    req = reqs[rid] = _Request()
                req.batches.append(batch)
        return batch

    # -- called by the scheduler --------------------------------------------------------
    def batch_done(self, batch: Batch) -> None:
        """``batch`` completed: taken in when this client next looks at its maps."""
        self._done.append(batch)

    # -- completion -------------------------------------------------------------------
    def get_finished(
        self, finished_req_ids: Iterable[str], timeout: float | None = None
    ) -> FinishedDumps:
        """Requests whose dumps are all done, among those ever passed here as finished.

        Default: never blocks; ids whose dumps are running are reported by a later call.
        With the scheduler's ``blocking_finish=True``: waits (up to ``timeout``; None = as
        long as it takes) for the dumps of this call's finished requests, then reports
        them. Unknown ids (no dumps registered on this client) are ignored.
        """
        sched = self.scheduler
        sched.poll()  # finished dumps retired: their completed batches are queued here
        now = perf_counter_ns()
        targets: list[str] = []
        with self._lock:
            self._take_done()
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
            sched.wait_until(lambda: self._drained(targets), timeout)
        with self._lock:
            self._take_done()
            ready, self._ready = self._ready, {}
            waits, self._waits_ns = self._waits_ns, []
        failed = {rid for rid, bad in ready.items() if bad}
        if ready or waits:
            sched.requests_reported(len(ready), len(failed), waits)
        return FinishedDumps(set(ready), failed)

    def handle_preemptions(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Wait for the dumps reading the preempted requests' blocks, then forget them.

        Only dumps that read these requests' blocks are waited for. Call before the
        forward pass that may overwrite the blocks. Returns False if ``timeout`` expired
        first (the requests are forgotten anyway; their dumps keep running).
        """
        sched = self.scheduler
        t0 = perf_counter_ns()
        with self._lock:
            targets = [rid for rid in req_ids if rid in self._reqs]
        if not targets:
            return True
        done = sched.wait_until(lambda: self._drained(targets), timeout)
        with self._lock:
            self._take_done()
            for rid in targets:
                req = self._reqs.pop(rid, None)
                if req is not None and req.finished_ns and req.batches:
                    self._finished_waiting -= 1
        sched.preempt_waited((perf_counter_ns() - t0) / 1e9)
        return done

    # -- queries ----------------------------------------------------------------------
    def needs_delayed_free(self, req_id: str) -> bool:
        """True while ``req_id`` has dumps registered here and was not yet reported."""
        with self._lock:
            return req_id in self._reqs or req_id in self._ready

    def has_pending(self) -> bool:
        """True while this client's finished requests wait for dumps or to be reported.

        A connector can return this from vLLM's ``has_pending_push_work`` so the engine
        keeps stepping until held blocks are released (LMCache #4998).
        """
        self.scheduler.poll()
        return self.reports_pending()

    def reports_pending(self) -> bool:
        """:meth:`has_pending` without retiring finished dumps first."""
        with self._lock:
            self._take_done()
            return bool(self._ready or self._finished_waiting)

    def sizes(self) -> dict[str, int]:
        """This client's map sizes."""
        with self._lock:
            self._take_done()
            return {
                "requests": len(self._reqs),
                "ready": len(self._ready),
                "finished_waiting": self._finished_waiting,
            }

    def open_batches(self) -> list[Batch]:
        """This client's batches not yet completed (each once)."""
        with self._lock:
            self._take_done()
            batches = {id(b): b for req in self._reqs.values() for b in req.batches}
        return list(batches.values())

    # -- shutdown ---------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Seal this client's open batches and wait up to ``timeout`` seconds for their
        dumps (connector shutdown: the last steps' KV gets stored unless the store hangs).
        Returns False when some were still running."""
        for batch in self.open_batches():
            self.seal(batch)
        with self._lock:
            targets = list(self._reqs)
        if not targets:
            return True
        return self.scheduler.wait_until(lambda: self._drained(targets), timeout)

    def close(self) -> None:
        """Forget this client (connector shutdown); its running dumps still finish."""
        for batch in self.open_batches():
            self.seal(batch)
        with self._lock:
            self._reqs.clear()
            self._ready.clear()
            self._done.clear()
            self._finished_waiting = 0
            self._closed = True
        self.scheduler.remove_client(self)

    # -- private (own lock held) --------------------------------------------------------
    def _take_done(self) -> None:
        """Take in the batches the scheduler completed: their requests with no batch left
        become reportable."""
        done = self._done
        reqs = self._reqs
        now = 0
        while done:
            batch = done.popleft()
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
        self._waits_ns.append(now - req.finished_ns)

    def _drained(self, targets: list[str]) -> bool:
        """No dump of ``targets`` is still queued or running (the scheduler may hold its
        lock: this one is a leaf)."""
        with self._lock:
            reqs = self._reqs
            for rid in targets:
                req = reqs.get(rid)
                if req is not None:
                    for b in req.batches:
                        if b.pending:
                            return False
        return True
