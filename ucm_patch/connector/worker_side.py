"""Worker side of the KV connector: page views, dumps through the DumpScheduler, loads.

Runs in each vLLM worker process. Every storage row (layers whose pages alias) is seen as
one :class:`~ucm_patch.connector.page_views.PageView` over vLLM's own KV-cache memory,
derived from the registered tensor's shape and strides: a page is K|V in one fixed order
for attention rows, the raw block-major page for rows shared with GDN / Mamba states.
Block ids are checked against the view on the host before any gather or copy.

**Dumps.** ``bind_connector_metadata`` opens one :class:`~ucm_patch.hooks.dump.Batch`
per step for the requests with dump entries and precomputes each row's keys and block
indices (once per step, not per layer). ``save_kv_layer`` at a row's last layer submits the
row (:func:`ucm_patch.connector.rows.RowMap.dump_row`: one dict lookup on the hot path); rows
whose last layer never called ``save_kv_layer`` are submitted in ``wait_for_save``, after
the whole forward, so a layer without hooks never makes a block half-stored. When the
scheduler pinned the blocks (``metadata.pinned``) the copy runs on a dump thread after the
layer's event; otherwise it is taken before ``save_kv_layer`` returns.

**Loads** (layerwise rows ahead of the forward, async requests between steps, and how a
failed load becomes vLLM's recomputation) are :mod:`ucm_patch.connector.worker_loads`'s.

**Shutdown** is bounded by the dump scheduler's ``exit_flush_s`` (``dump_exit_flush_s``):
the load threads are daemons (:mod:`ucm_patch.connector.load_threads`) and this
connector's dumps get a bounded flush, so a hung store cannot hang vLLM's shutdown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from functools import partial
from time import monotonic
from typing import Any

import torch

from ucm_patch.connector import counters as stats
from ucm_patch.connector.config import ConnectorConfig
from ucm_patch.connector.layout import KVLayout
from ucm_patch.connector.load_threads import LoadThreads
from ucm_patch.connector.meta import (
    RequestLoad,
    UCMConnectorMetadata,
    UCMWorkerMetadata,
)
from ucm_patch.connector.page_views import (
    AttentionShape,
    PageView,
    UnknownKVLayout,
    attention_view,
    placement_view,
    raw_view,
)
from ucm_patch.connector.row_loads import LoadJob, RowLoads, StepLoad
from ucm_patch.connector.rows import RowLoader
from ucm_patch.connector.staging import StagedPages, StagingBuffers
from ucm_patch.connector.worker_loads import WorkerLoads
from ucm_patch.hooks.dump import Batch, DumpScheduler, get_scheduler
from ucm_patch.hooks.ratelimit import RateLimitedLog
from ucm_patch.hooks.stores.base import KVStore

# Under vLLM's logger: its handler, level and format (``INFO mm-dd hh:mm:ss [file:line]``).
logger = logging.getLogger(f"vllm.{__name__}")

# (keys, payload callable for the dump thread) of one row's dump this step
_RowPlan = tuple[list[str], Callable[[Any], list[memoryview]]]


def copy_pages(
    view: PageView,
    idx: torch.Tensor,
    counts: tuple[int, ...],
    staging: StagingBuffers,
    _task: Any = None,
) -> StagedPages:
    """Host copies of the pages ``idx`` (bounds-checked by the caller) of a row view, back
    to back in a buffer lent by ``staging`` (given back by the dump scheduler once the
    store has copied them: :meth:`StagedPages.release`): one memoryview per value, value
    ``i`` the next ``counts[i]`` pages (a chunk is a slice of the buffer, not a copy).

    ``_task``: the dump task when called as a DumpScheduler payload, on a dump thread
    that has waited for the layer's KV-ready event (the copy then waits for nothing
    else); None when the forward thread copies (an eager dump: the copy waits for its
    current stream, where the layer's KV was written).
    """
    n, page = idx.numel(), view.page_bytes
    buf = staging.take(n * page)
    try:
        rows = buf[: n * page].view(n, page)
        with staging.on_stream(after_current=_task is None):
            view.gather_into(idx, rows)
        flat = memoryview(rows.numpy()).cast("B")
    except BaseException:
        staging.give(buf)
        raise
    values: list[memoryview] = []
    at = 0
    for k in counts:
        values.append(flat[at : at + k * page])
        at += k * page
    return StagedPages(values, staging, buf)


#: The largest load buffer made ahead (pinned, per load thread): a row of a 32K-token hit
#: of Qwen3-8B's shape. A longer context's first hit makes its larger buffer then.
RESERVE_MAX_BYTES = 128 << 20


class WorkerSide(WorkerLoads):
    """The worker-side half of :class:`ucm_patch.connector.UCMPatchConnector`."""

    def __init__(
        self,
        layout: KVLayout,
        config: ConnectorConfig,
        store: KVStore,
        kv_cache_config: Any,
        rank: int,
        *,
        can_load: bool,
        can_dump: bool,
        scheduler: DumpScheduler | None = None,
        reserve_tokens: int = 0,
    ) -> None:
        self.layout = layout
        #: a device's load buffers are made for a hit of this many tokens when the caches
        #: are registered (vLLM's max_model_len; 0: on first use)
        self.reserve_tokens = reserve_tokens
        self.config = config
        self.store = store
        self.kv_cache_config = kv_cache_config
        self.rank = rank
        self.can_load = can_load
        self.can_dump = can_dump
        self.sched = scheduler or get_scheduler(
            workers=config.dump_workers,
            capacity=config.dump_queue_capacity,
            on_full=config.dump_on_full,
            full_wait_s=config.dump_full_wait_s,
            blocking_finish=config.blocking_finish,
        )
        # This connector's request ids: another connector in the process has its own.
        self.dumps = self.sched.client(f"worker-{rank}")
        n = len(layout.rows)
        self.views: list[PageView | None] = [None] * n
        #: host buffers of dumps and loads (pinned on an accelerator): register_kv_caches
        self.staging = self._staging_for(torch.device("cpu"))
        # Bound once for the save hook (once per layer per step).
        self._save_row_of = layout.rows.save_row_of
        if config.dump_exit_flush_s is not None:
            self.sched.set_exit_flush(config.dump_exit_flush_s)
        self._pool = LoadThreads(config.load_workers)
        #: layer -> wait_for_layer_load / save_kv_layer calls seen in this process. A layer
        #: missing from wait_calls has no load hook here (see start_load_kv).
        self.wait_calls: dict[str, int] = {}
        self.save_calls: dict[str, int] = {}
        # -- per step: dumps
        self._batch: Batch | None = None
        self._pinned = False
        self._row_plans: list[_RowPlan | None] = [None] * n
        self._row_done = bytearray(n)
        self._open_steps: list[tuple[int, Batch]] = []
        # -- per step: layerwise loads
        self._row_jobs: list[list[LoadJob]] = [[] for _ in range(n)]
        self._load_blocks: dict[str, list[int]] = {}
        self._loader = RowLoader(
            layout.rows, self._submit_row_load, self._wait_row_load, depth=config.load_prefetch_rows
        )
        self._loading = False
        self._step: StepLoad | None = None  # this step's loads into a host cache
        self._in_layer = False
        self._stall_s = 0.0  # this step's waits for rows (counters.SECONDS)
        self._load_errors: set[int] = set()
        # An exception in a load is logged once per (site, exception type) per connector,
        # with its traceback; every occurrence is counted in ``load_exceptions``.
        self._exception_log = RateLimitedLog(logger, interval_s=math.inf)
        # Missing values and store errors repeat per page and step: a line per cause a minute.
        self._warning_log = RateLimitedLog(logger, interval_s=60.0)
        #: the load path (load threads), over ``views``
        self.loads = RowLoads(store, self.views, self.staging, self.load_exception,
                              self._warning_log)  # fmt: skip
        # -- async loads
        self._async_loads: list[RequestLoad] = []
        self._async: dict[str, tuple[Future[set[str]], list[int]]] = {}

    # ---------------------------------------------------------------------------------
    # KV caches
    # ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Build one page view per storage row over vLLM's KV-cache memory, derived from
        each tensor's shape and strides (:mod:`ucm_patch.connector.page_views`).

        Raises :class:`~ucm_patch.connector.page_views.UnknownKVLayout` (naming the layer,
        shape and strides) for a layout it cannot map: the connector refuses to start
        rather than move the wrong bytes."""
        cfg = self.kv_cache_config
        placements = _placements(cfg)
        num_blocks_of = getattr(cfg, "num_blocks_of", None)  # vLLM >= 0.32: per pool
        shapes = _attention_shapes(cfg)
        mamba = {layer for g in self.layout.mamba_groups for layer in g.layers}
        for row in self.layout.rows.rows:
            layer = row.layers[0]
            if layer not in kv_caches:
                raise ValueError(f"register_kv_caches: no KV cache for layer {layer!r}")
            tensor = kv_caches[layer]
            placed = placements.get(layer)
            blocks = cfg.num_blocks
            if placed is not None and num_blocks_of is not None:
                blocks = int(num_blocks_of(placed[0]))
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and placed is not None:
                view = placement_view(tensor, *placed, blocks, layer)
            elif mamba.intersection(row.layers):
                page = self.layout.row_page_bytes[row.index]
                view = raw_view(tensor, blocks, page, layer, shapes.get(layer))
            elif layer in shapes:
                view = attention_view(tensor, blocks, shapes[layer], layer)
            else:
                raise UnknownKVLayout(f"layer {layer!r}: no attention or mamba KV-cache spec")
            self.views[row.index] = view
            logger.debug("ucm connector: row %d (%s): %s", row.index, layer, view.layout)
            if view.view.device != self.staging.device:
                self.staging = self._staging_for(view.view.device)
        self.loads.staging = self.staging
        self.loads.plan_rows()
        if self.can_load and self.staging.pinned and self.reserve_tokens:
            nbytes = min(self._row_bytes(self.reserve_tokens), RESERVE_MAX_BYTES)
            self.staging.reserve(nbytes, self.config.load_workers)

    def _row_bytes(self, tokens: int) -> int:
        """The most bytes one row loads for a hit of ``tokens`` tokens."""
        most = 0
        for group in self.layout.groups:
            pages = -(-tokens // group.block_size) if group in self.layout.attention_groups else 1
            for r in self.layout.rows_of_group[group.index]:
                view = self.views[r]
                if view is not None:
                    most = max(most, pages * view.page_bytes)
        return most

    def _staging_for(self, device: torch.device) -> StagingBuffers:
        """Host buffers for ``device``, offered to the store for zero-copy puts."""
        store = self.store
        return StagingBuffers(device, store.register_host_memory, store.unregister_host_memory)

    # ---------------------------------------------------------------------------------
    # Per step
    # ---------------------------------------------------------------------------------
    def bind(self, md: UCMConnectorMetadata) -> None:
        """Prepare this step's dumps and loads (once per step)."""
        for jobs in self._row_jobs:
            jobs.clear()
        self._load_blocks.clear()
        if md.dumps and self.can_dump:
            self._open_dumps(md)
        if md.loads and self.can_load:
            self._prepare_loads(md.loads)

    def _open_dumps(self, md: UCMConnectorMetadata) -> None:
        # A batch left open (no wait_for_save since) would never be reported: close it.
        self._close_dumps()
        layout = self.layout
        batch = self.dumps.open_batch(md.dumps.keys(), self.store, md.step)
        self._batch = batch
        self._pinned = md.pinned
        self._row_done[:] = bytes(len(self._row_done))
        # row -> (keys, the block ids of each key's value)
        per_row: list[tuple[list[str], list[tuple[int, ...]]]] = [([], []) for _ in self._row_plans]
        for entries in md.dumps.values():
            for group, block_ids, block_hash in entries:
                for r in layout.rows_of_group[group]:
                    keys, values = per_row[r]
                    keys.append(layout.key(block_hash, group, r, self.rank))
                    values.append(block_ids)
        pages = n_values = nbytes = 0
        for r, (keys, values) in enumerate(per_row):
            view = self.views[r]
            if not keys:
                self._row_plans[r] = None
                continue
            if view is None:
                raise RuntimeError("ucm connector: dump planned before register_kv_caches")
            bad = view.out_of_range([b for ids in values for b in ids])
            if bad:  # never launched: on CUDA an out-of-range gather kills the engine
                keys, values = self._drop_out_of_range(r, keys, values, set(bad), view)
                if not keys:
                    self._row_plans[r] = None
                    continue
            flat = [b for ids in values for b in ids]
            idx = torch.tensor(flat, dtype=torch.long, device=view.view.device)
            counts = tuple(len(ids) for ids in values)
            # Built once per step: the per-layer submit allocates nothing.
            self._row_plans[r] = (keys, partial(copy_pages, view, idx, counts, self.staging))
            pages += len(flat)
            n_values += len(keys)
            nbytes += len(flat) * view.page_bytes
        stats.bump("dump_pages", pages)
        if n_values:  # the store gets ready for the step's puts (their leases), never waits
            self.store.expect_puts(n_values, nbytes, self.sched.config["workers"])
        if md.pinned:
            self._open_steps.append((md.step, batch))

    def _drop_out_of_range(
        self,
        row: int,
        keys: list[str],
        values: list[tuple[int, ...]],
        bad: set[int],
        view: PageView,
    ) -> tuple[list[str], list[tuple[int, ...]]]:
        """The values of ``row`` whose block ids all exist; the others are counted (their
        pages) and logged (a scheduler / worker disagreement on the block count), never
        copied."""
        kept = [(k, ids) for k, ids in zip(keys, values, strict=True) if bad.isdisjoint(ids)]
        dropped = sum(len(ids) for ids in values) - sum(len(ids) for _k, ids in kept)
        stats.bump("dump_pages_out_of_range", dropped)
        self._warning_log.error(
            ("dump range", row),
            "ucm connector: dump of row %d names block ids %s outside the %d blocks of its "
            "KV cache (%s); those pages are not dumped",
            row,
            sorted(bad)[:8],
            view.num_blocks,
            view.layout,
        )
        return [k for k, _ in kept], [ids for _, ids in kept]

    def _close_dumps(self) -> None:
        """Submit the rows whose save layer never ran (after the forward), then seal."""
        batch = self._batch
        if batch is None:
            return
        for row in range(len(self._row_done)):
            if not self._row_done[row]:
                self._row_done[row] = 1
                self._submit_row(row, None, None)
        self.sched.seal(batch)
        self._batch = None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Hot path: submit the row whose last layer just ran.

        vLLM's signature (the connector binds this method as its own ``save_kv_layer``);
        ``kv_layer`` is unused: dumps read the registered caches by block id."""
        calls = self.save_calls
        calls[layer_name] = calls.get(layer_name, 0) + 1
        if self._batch is None:
            return
        row = self._save_row_of.get(layer_name, -1)  # RowMap.dump_row, inlined
        if row < 0 or self._row_done[row]:
            return
        self._row_done[row] = 1
        plan = self._row_plans[row]
        if plan is not None and self._pinned:
            # The common case, one frame less (per layer per step): the dump thread waits
            # for this layer's event, then copies the pages.
            self.sched.submit_layer(self._batch, layer_name, attn_metadata, row, *plan)
        else:
            self._submit_row(row, layer_name, attn_metadata)

    def _submit_row(self, row: int, layer_name: str | None, attn_metadata: Any) -> None:
        plan = self._row_plans[row]
        batch = self._batch
        if plan is None or batch is None:
            return
        keys, produce = plan
        sched = self.sched
        if not self._pinned:
            # Nothing holds the blocks after this step: copy now, store asynchronously.
            stats.bump("dump_pages_eager", len(keys))
            pages = produce(None)
            queued = False
            try:
                queued = sched.submit(batch, row, keys, pages)
            finally:
                if not queued:  # skipped: the scheduler never runs it, so the buffer is ours
                    pages.release()
        elif layer_name is None:
            event, owned, source = sched.events.record()
            sched.submit(batch, row, keys, produce, event, owned, source)
        else:
            sched.submit_layer(batch, layer_name, attn_metadata, row, keys, produce)

    def wait_for_save(self) -> None:
        """Submit rows no hook dumped, seal the step's batch, finish layerwise loads."""
        self._close_dumps()
        if self._loading:
            self._loading = False
            try:
                self._loader.drain()
            except Exception as exc:  # never into vLLM's step
                self._fail_step_loads("wait_for_save", exc)
            self._finish_step_load()
            stats.bump("load_stall_s", self._stall_s)  # once per step, not per row
            self._stall_s = 0.0

    # ---------------------------------------------------------------------------------
    # Completion
    # ---------------------------------------------------------------------------------
    def transfer_results(
        self, finished_req_ids: set[str], failures_as_block_errors: bool = False
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step.

        ``failures_as_block_errors``: also report a failed async load's blocks through
        :meth:`block_ids_with_load_errors` (vLLM without ``failed_recving``).
        """
        done = self.dumps.get_finished(finished_req_ids)
        if done.failed:
            logger.warning(
                "ucm connector: %d finished request(s) had dumps that failed or were "
                "skipped (their blocks are not fully stored)",
                len(done.failed),
            )
        recving: set[str] = set()
        failed: set[str] = set()
        for rid, (fut, blocks) in list(self._async.items()):
            if not fut.done():
                continue
            del self._async[rid]
            recving.add(rid)
            exc = CancelledError() if fut.cancelled() else fut.exception()
            if exc is not None:
                # Thread boundary: a bug in a load must fail the request (recompute),
                # not leave it waiting forever.
                self.load_exception("async load", exc)
                failed.add(rid)
            elif fut.result():
                failed.add(rid)
            if rid in failed and failures_as_block_errors:
                self._load_errors.update(blocks)
        if failed:
            stats.bump("load_failed_requests", len(failed))
        if done.sending:
            stats.bump("finished_sending", len(done.sending))
        if recving:
            stats.bump("finished_recving", len(recving))
        return done.sending, recving, failed

    def handle_preemptions(self, req_ids: Iterable[str]) -> None:
        """Wait for the dumps that read preempted requests' blocks, then forget them."""
        ids = set(req_ids)
        if ids:
            self.dumps.handle_preemptions(ids)

    def worker_meta(self) -> UCMWorkerMetadata | None:
        """Pinned steps whose dumps are all done (the scheduler side unpins them)."""
        if not self._open_steps:
            return None
        done: dict[int, int] = {}
        keep: list[tuple[int, Batch]] = []
        for step, batch in self._open_steps:
            if batch.done:
                done[step] = 1
            else:
                keep.append((step, batch))
        self._open_steps = keep
        return UCMWorkerMetadata(done) if done else None

    def internal_sizes(self) -> dict[str, int]:
        """Sizes of every per-request / per-step map (all 0 between steps once every
        request finished and its dumps and loads were reported)."""
        return {
            "open_batch": int(self._batch is not None),
            "open_steps": len(self._open_steps),
            "load_requests": len(self._load_blocks),
            "load_errors": len(self._load_errors),
            "async_loads_queued": len(self._async_loads),
            "async_loads_running": len(self._async),
            "row_jobs": sum(len(jobs) for jobs in self._row_jobs),
            "staging_lent": self.staging.lent,
        }

    @property
    def open_batch(self) -> Batch | None:
        """This step's dump batch (None between steps), for benchmarks that submit to the
        dump scheduler directly."""
        return self._batch

    def row_plan(self, row: int) -> _RowPlan | None:
        """Storage row ``row``'s dump this step, (keys, page producer) or None, for
        benchmarks that submit it to the dump scheduler directly."""
        return self._row_plans[row]

    def shutdown(self) -> bool:
        """Stop the load threads and flush and close this connector's dump client, all
        within the scheduler's ``exit_flush_s`` (``dump_exit_flush_s``).

        vLLM calls it on the engine's way down: an unbounded wait (a hung store under a
        load or a dump) would hang the shutdown. Queued loads are cancelled first (nothing
        will consume them), then this client's dumps get the time left to finish, then the
        load threads. Returns False when something was still running at the deadline: the
        threads are daemons, so it cannot hold the process's exit either; dumps still in
        flight are the dump scheduler's to count at exit.
        """
        bound = self.sched.exit_flush_s
        deadline = monotonic() + bound
        self._pool.shutdown(0.0)  # cancel queued loads, ask the threads to stop
        self._close_dumps()
        flushed = self.dumps.flush(max(0.0, deadline - monotonic()))
        self.dumps.close()
        stopped = self._pool.shutdown(max(0.0, deadline - monotonic()))
        if not (flushed and stopped):
            logger.warning(
                "ucm connector: shutdown after %g s with %s still running",
                bound,
                " and ".join(
                    what for what, ok in (("dumps", flushed), ("a load", stopped)) if not ok
                ),
            )
        return flushed and stopped


def _placements(cfg: Any) -> dict[str, tuple[Any, int]]:
    """layer -> (its ``KVCacheTensor``, its index there) on vLLM >= 0.32 (older tensors
    have ``shared_by``, no placement)."""
    return {
        layer: (tensor, index)
        for tensor in getattr(cfg, "kv_cache_tensors", ())
        for index, layer in enumerate(getattr(tensor, "layers", None) or ())
    }


def _attention_shapes(cfg: Any) -> dict[str, AttentionShape]:
    """layer -> what its attention page holds, from the groups' KV-cache specs."""
    out: dict[str, AttentionShape] = {}
    for group in cfg.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)  # UniformType...
        for layer in group.layer_names:
            spec = per_layer[layer] if per_layer else group.kv_cache_spec
            heads = getattr(spec, "num_kv_heads", None)
            head_size = getattr(spec, "head_size", None)
            if heads is None or head_size is None:
                continue  # a mamba / GDN state
            mla = any("MLA" in cls.__name__ for cls in type(spec).__mro__)
            out[layer] = AttentionShape(int(spec.block_size), int(heads), int(head_size), mla)
    return out
