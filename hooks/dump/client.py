"""DumpClient: one connector's request-id space on the shared :class:`DumpScheduler`.

Request ids are unique only within one engine (``LLM`` numbers its requests "0", "1", ...)
and vLLM requires each connector to report only ids it was given, so every connector
instance takes its own client. The client's maps are guarded by the scheduler's lock, which
the scheduler hands over when it makes the client: a batch's completion (scheduler side)
and a request's report (client side) update them together.

The per-layer submit takes no lock: it counts into the client's ``tally`` (one slot per
event source and ownership), written only by the thread that drives the connector (vLLM
steps a connector from one thread), and the scheduler folds the tallies into the shared
metrics under its lock when it retires or when metrics are read (single-writer counters,
summed when read).
"""

from __future__ import annotations

from collections.abc import Iterable
from time import perf_counter_ns
from typing import Any

from ucm_patch.hooks.dump.types import Batch, FinishedDumps
from ucm_patch.hooks.events import EventSource
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from ucm_patch.hooks.dump.scheduler import DumpScheduler
    from ucm_patch.hooks.stores.base import KVStore


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
        "_finished_waiting",
        "_lock",
        "_ready",
        "_reqs",
        "folded",
        "name",
        "scheduler",
        "seal",
        "submit",
        "submit_layer",
        "tally",
    )

    def __init__(self, scheduler: DumpScheduler, name: str, lock: threading.Lock) -> None:
        self.scheduler = scheduler
        self.name = name
        self._lock = lock  # the scheduler's: see the module docstring
        self._closed = False
        self._reqs: dict[str, _Request] = {}
        self._ready: dict[str, bool] = {}  # reportable request id -> failed
        self._finished_waiting = 0  # finished requests with dumps still running
        # Submits by (source << 1 | owned): written by this client's submitting thread
        # only; ``folded`` is the part already added to the metrics (scheduler lock).
        self.tally = [0] * (2 * len(EventSource))
        self.folded = [0] * (2 * len(EventSource))
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
        sched = self.scheduler
        with self._lock:
            if self._closed or sched.closed:
                raise RuntimeError(
                    f"DumpClient.open_batch: client {self.name!r} is closed or the "
                    "scheduler is shut down"
                )
            reqs = self._reqs
            for rid in ids:
                req = reqs.get(rid)
                if req is None:
                    req = reqs[rid] = _Request()
                elif req.finished_ns:
                    raise ValueError(
                        f"DumpClient.open_batch: request id {rid!r} was already passed to "
                        "get_finished and its dumps are still tracked"
                    )
                req.batches.append(batch)
            sched.batch_opened_locked()
        return batch

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
        lock = self._lock
        now = perf_counter_ns()
        targets: list[str] = []
        with lock:
            sched.retire_locked()
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
        with lock:
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
        sched = self.scheduler
        t0 = perf_counter_ns()
        with self._lock:
            targets = [rid for rid in req_ids if rid in self._reqs]
        if not targets:
            return True
        done = sched.wait_until(lambda: self._drained(targets), timeout)
        with self._lock:
            for rid in targets:
                req = self._reqs.pop(rid, None)
                if req is not None and req.finished_ns and req.batches:
                    self._finished_waiting -= 1
            sched.metrics.preempt_wait.observe((perf_counter_ns() - t0) / 1e9)
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
        with self._lock:
            self.scheduler.retire_locked()
            return self.has_pending_locked()

    def has_pending_locked(self) -> bool:
        """:meth:`has_pending` without retiring finished dumps (caller holds the lock)."""
        return bool(self._ready or self._finished_waiting)

    def sizes(self) -> dict[str, int]:
        """This client's map sizes (caller may hold the scheduler lock or not)."""
        return {
            "requests": len(self._reqs),
            "ready": len(self._ready),
            "finished_waiting": self._finished_waiting,
        }

    # -- shutdown ---------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Seal this client's open batches and wait up to ``timeout`` seconds for their
        dumps (connector shutdown: the last steps' KV gets stored unless the store hangs).
        Returns False when some were still running."""
        with self._lock:
            self.seal_open_locked()
            targets = list(self._reqs)
        if not targets:
            return True
        return self.scheduler.wait_until(lambda: self._drained(targets), timeout)

    def close(self) -> None:
        """Forget this client (connector shutdown); its running dumps still finish."""
        with self._lock:
            self.seal_open_locked()
            self._reqs.clear()
            self._ready.clear()
            self._finished_waiting = 0
            self._closed = True
            self.scheduler.remove_client_locked(self)

    def seal_open_locked(self) -> None:
        """Seal every open batch of this client (caller holds the lock).

        Sealing may complete a batch, which edits the maps walked here: walk copies."""
        seal = self.scheduler.seal_locked
        for req in list(self._reqs.values()):
            for batch in list(req.batches):
                seal(batch)

    # -- called by the scheduler, lock held ---------------------------------------------
    def batch_done_locked(self, batch: Batch) -> None:
        """``batch`` finished: its requests with no batch left become reportable."""
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

    # -- private ----------------------------------------------------------------------
    def _report_ready(self, rid: str, req: _Request, now: int) -> None:
        del self._reqs[rid]
        self._ready[rid] = req.failed
        self.scheduler.metrics.request_wait.observe((now - req.finished_ns) / 1e9)

    def _drained(self, targets: list[str]) -> bool:
        reqs = self._reqs
        for rid in targets:
            req = reqs.get(rid)
            if req is not None:
                for b in req.batches:
                    if b.pending:
                        return False
        return True
