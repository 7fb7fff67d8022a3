"""The worker side's loads (:class:`WorkerLoads`, a part of
:class:`~ucm_patch.connector.worker_side.WorkerSide`): this step's loads planned from the
scheduler's metadata, started, waited for per layer, and their failures turned into
vLLM's recomputation.

**Loads.** Layerwise: ``start_load_kv`` starts ``load_prefetch_rows`` rows on the load
threads, ``wait_for_layer_load`` waits only for the layer's row
(:class:`~ucm_patch.connector.rows.RowLoader`). A row holding a layer that was never seen
calling ``wait_for_layer_load`` in this process (no hook on that layer, or the first step of
a new process) is loaded completely in ``start_load_kv`` instead: a load is never
"waited for" by a hook that does not fire. Async: each request loads on the load threads
between steps and is reported in ``finished_recving``. What a load thread does with a row
(the copy plan, its executors) is :mod:`ucm_patch.connector.row_loads`.

**Load errors.** A missing, corrupt (checksum) or wrong-sized value, a store error, or any
other exception raised while loading (a torch copy error, a store raising something other
than ``StoreError``, a load thread that cannot start) fails the whole request's load: it is
counted (``load_errors`` per page, ``load_exceptions`` per exception) and logged once per
cause, and never propagates into vLLM, where it would kill the engine (vLLM's own hooks) or
turn a wrapped layer into a silent pass-through with its KV not loaded. Layerwise: all its
loaded block ids go to ``get_block_ids_with_load_errors`` and vLLM
(``kv_load_failure_policy="recompute"``) recomputes them. Async: the request is reported
in ``failed_recving`` (vLLM >= 0.30, ``get_transfer_results``) or its blocks as load errors
(vLLM <= 0.29, ``get_finished``; several KV-cache groups there need the
``hybrid_load_failure`` patch, docs/CONNECTOR.md "A failed load, per release").
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from time import monotonic

from ucm_patch.connector import counters as stats
from ucm_patch.connector.config import ConnectorConfig
from ucm_patch.connector.layout import KVLayout
from ucm_patch.connector.load_threads import LoadThreads
from ucm_patch.connector.meta import NULL_BLOCK, RequestLoad
from ucm_patch.connector.row_loads import LoadJob, RowLoads, StepLoad
from ucm_patch.connector.rows import RowLoader
from ucm_patch.hooks.ratelimit import RateLimitedLog


class WorkerLoads:
    """The load path of a :class:`~ucm_patch.connector.worker_side.WorkerSide`: its state
    (below) is set up by the worker side's ``__init__``."""

    layout: KVLayout
    config: ConnectorConfig
    rank: int
    loads: RowLoads
    wait_calls: dict[str, int]
    _pool: LoadThreads
    _loader: RowLoader
    _row_jobs: list[list[LoadJob]]
    _load_blocks: dict[str, list[int]]
    _loading: bool
    _step: StepLoad | None
    _in_layer: bool
    _stall_s: float
    _load_errors: set[int]
    _exception_log: RateLimitedLog
    _async_loads: list[RequestLoad]
    _async: dict[str, tuple[Future[set[str]], list[int]]]

    def _finish_step_load(self) -> None:
        """The step's failures (:class:`StepLoad`): load errors before the step ends."""
        step, self._step = self._step, None
        if step is None:
            return
        try:
            failed = step.finish()
        except Exception as exc:  # _load_rows catches; this is the last guard
            self._fail_step_loads("row load", exc)
            return
        for rid in failed:
            self._fail_layerwise(rid)

    def _prepare_loads(self, loads: Iterable[RequestLoad]) -> None:
        layout = self.layout
        for load in loads:
            if load.is_async:
                self._async_loads.append(load)
                continue
            blocks = self._load_blocks.setdefault(load.req_id, [])
            for group, dsts, block_hash in load.entries:
                blocks.extend(d for d in dsts if d != NULL_BLOCK)
                for r in layout.rows_of_group[group]:
                    key = layout.key(block_hash, group, r, self.rank)
                    self._row_jobs[r].append((load.req_id, key, dsts))

    def start_load_kv(self) -> None:
        """Start this step's loads (layerwise rows ahead; async requests on threads)."""
        if self._load_blocks:
            try:
                self._start_layerwise()
            except Exception as exc:  # never into vLLM's step
                self._fail_step_loads("start_load_kv", exc)
        for load in self._async_loads:
            stats.bump("loads_async")
            blocks = [d for _g, dsts, _h in load.entries for d in dsts if d != NULL_BLOCK]
            try:
                future = self._pool.submit(self._load_request, load)
            except Exception as exc:  # e.g. the load threads were shut down
                future = Future()
                future.set_exception(exc)  # reported as failed_recving by transfer_results
            self._async[load.req_id] = (future, blocks)
        self._async_loads = []

    def _start_layerwise(self) -> None:
        self._finish_step_load()  # a step left unfinished (no wait_for_save since)
        # a cache in host memory: the step's rows in one store call per load thread
        self._step = self.loads.start_step(
            self._row_jobs, self._pool.submit, self.config.load_workers
        )
        self._loader.start()
        self._loading = True
        rows = self.layout.rows.rows
        unseen = any(
            jobs and any(layer not in self.wait_calls for layer in rows[r].layers)
            for r, jobs in enumerate(self._row_jobs)
        )
        if unseen:
            stats.bump("loads_sync_fallback")
            self._loader.drain()
        else:
            stats.bump("loads_layerwise")

    def load_exception(self, site: str, exc: BaseException) -> None:
        """Count an exception raised while loading; log it once per (site, type) with its
        traceback. The caller turns it into load errors for the affected requests."""
        stats.bump("load_exceptions")
        self._exception_log.error(
            (site, type(exc)),
            "ucm connector: %s raised %s: %s; the affected blocks are recomputed (logged "
            "once per cause, counted in load_exceptions)",
            site,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )

    def _fail_step_loads(self, site: str, exc: BaseException) -> None:
        """An exception escaped the row loader: every layerwise load of this step fails
        (vLLM recomputes those blocks); counted and logged once per cause."""
        self.load_exception(site, exc)
        for rid in self._load_blocks:
            self._fail_layerwise(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Hot path: wait for ``layer_name``'s row (no-op when nothing loads this step)."""
        calls = self.wait_calls
        calls[layer_name] = calls.get(layer_name, 0) + 1
        if self._loading:
            self._in_layer = True
            try:
                self._loader.on_layer(layer_name)
            except Exception as exc:  # never into vLLM's forward
                self._fail_step_loads("wait_for_layer_load", exc)
            finally:
                self._in_layer = False

    def _submit_row_load(self, row: int) -> Future[set[str]] | StepLoad | None:
        jobs = self._row_jobs[row]
        if not jobs:
            return None
        if self._step is not None:  # already loading with the step's other rows
            return self._step
        return self._pool.submit(self.loads.load_row, row, list(jobs))

    def _wait_row_load(self, row: int, handle: Future[set[str]] | StepLoad | None) -> None:
        if handle is None:
            return
        if self._in_layer:
            stats.bump("rows_waited_in_layer")
        waited = monotonic()  # the forward stalls for the row: a clock read is nothing
        if isinstance(handle, StepLoad):  # its failures are known at the step's end
            handle.wait_row(row)
            self._stall_s += monotonic() - waited
            return
        try:
            failed = handle.result()
        except Exception as exc:  # _load_row catches; this is the last guard
            self.load_exception("row load", exc)
            failed = {rid for rid, _key, _dsts in self._row_jobs[row]}
        self._stall_s += monotonic() - waited  # counted in wait_for_save
        for rid in failed:
            self._fail_layerwise(rid)

    def _fail_layerwise(self, rid: str) -> None:
        blocks = self._load_blocks.get(rid, ())
        if blocks and not self._load_errors.issuperset(blocks):
            stats.bump("load_failed_requests")
        self._load_errors.update(blocks)

    def _load_request(self, load: RequestLoad) -> set[str]:
        """One async request: every row of every entry (load thread)."""
        layout = self.layout
        per_row: dict[int, list[LoadJob]] = {}
        for group, dsts, block_hash in load.entries:
            for r in layout.rows_of_group[group]:
                key = layout.key(block_hash, group, r, self.rank)
                per_row.setdefault(r, []).append((load.req_id, key, dsts))
        failed: set[str] = set()
        for r, jobs in per_row.items():
            failed |= self.loads.load_row(r, jobs)
            if failed:
                break  # the request recomputes anyway
        return failed

    def block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (then forgotten)."""
        errors, self._load_errors = self._load_errors, set()
        return errors


__all__ = ["WorkerLoads"]
