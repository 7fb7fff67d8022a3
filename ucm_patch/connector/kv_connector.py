"""``UCMPatchConnector``: the vLLM KV connector of ucm_patch (a thin facade).

vLLM builds the connector twice: once in the scheduler (``role=SCHEDULER``) and once per
worker (``role=WORKER``). The facade validates ``kv_connector_extra_config``
(:mod:`ucm_patch.connector.config`), derives the shared layout and keys
(:mod:`ucm_patch.connector.layout`), opens the store and hands every call to the side that
owns it: :mod:`ucm_patch.connector.scheduler_side` or :mod:`ucm_patch.connector.worker_side`. What
each side does, and why, is documented there and in docs/CONNECTOR.md.

Use it by name once the ucm_patch plugin ran (``VLLM_PLUGINS`` unset or listing
``ucm_patch``)::

    --kv-transfer-config '{"kv_connector": "UCMPatchConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "local",
                                                         "local_path": "/data/kv"}}'

or without the plugin via ``"kv_connector_module_path": "ucm_patch.connector"``. It also
works as a child of vLLM's ``MultiConnector``.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm_patch.connector import counters as connector_stats
from ucm_patch.connector import vllm_metrics as connector_metrics
from ucm_patch.connector import vllm_support
from ucm_patch.connector.config import ConnectorConfig, parse_connector_config
from ucm_patch.connector.layout import KVLayout
from ucm_patch.connector.meta import UCMConnectorMetadata
from ucm_patch.hooks import exit_sequence
from ucm_patch.hooks.stores import ValueSizeError, make_store
from ucm_patch.hooks.stores.base import KVStore
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.connector.scheduler_side import SchedulerSide
    from ucm_patch.connector.worker_side import WorkerSide

try:  # vLLM >= 0.12
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - vLLM <= 0.11: no hybrid KV-cache manager support
    SupportsHMA = object  # type: ignore[assignment,misc]

try:  # vLLM >= 0.30: get_transfer_results, failed_recving
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM <= 0.29 only has get_finished
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

# Under vLLM's logger: its handler, level and format (``INFO mm-dd hh:mm:ss [file:line]``).
logger = logging.getLogger(f"vllm.{__name__}")

NAME = "UCMPatchConnector"
_BASE_TAKES_KV_CACHE_CONFIG = (
    "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
)

# One store per store config per process: in single-process vLLM both connector roles
# live in one process and a Mooncake client must not be set up twice.
_stores: dict[str, KVStore] = {}
_stores_lock = threading.Lock()
_register_lock = threading.Lock()


def shared_store(config: ConnectorConfig, value_bytes: int = 0) -> KVStore:
    """This process's store for ``config`` (created on first use, closed at exit), made to
    hold values of ``value_bytes`` (the layout's largest): a configuration that cannot is
    refused here, at start, with a :class:`ValueSizeError` naming the keys and the size,
    never found out put by put (docs/CONNECTOR.md, "Values that do not fit")."""
    key = json.dumps([config.store_kind, dict(config.store)], sort_keys=True, default=str)
    hint = (
        f"; the connector's values are chunk_tokens ({config.chunk_tokens}) of whole blocks "
        "of one row's pages, or one state: a smaller chunk_tokens makes them smaller"
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            try:
                store = make_store(config.store_config, value_bytes=value_bytes)
            except ValueSizeError as exc:
                raise ValueSizeError(f"{exc}{hint}") from None
            _stores[key] = store
            exit_sequence.close_at_exit(_close_stores)  # after the dumps' flush
    limit = store.max_value_bytes()
    if limit is not None and value_bytes > limit:  # opened in this process for smaller ones
        raise ValueSizeError(
            f"{config.store_kind} store {dict(config.store)}: values of {value_bytes} bytes "
            f"do not fit, it was opened in this process for values up to {limit} bytes{hint}"
        )
    return store


def _close_stores() -> None:
    """Close this process's stores: the close phase of the exit sequence
    (:mod:`ucm_patch.hooks.exit_sequence`), which runs the dumps' flush before it."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()


class UCMPatchConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector on the dump scheduler and the local / Mooncake stores."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        if _BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - vLLM <= 0.11
            super().__init__(vllm_config, role)
        ktc = vllm_config.kv_transfer_config
        self.config = parse_connector_config(ktc.kv_connector_extra_config)
        self.layout = KVLayout.from_vllm(
            vllm_config, kv_cache_config, self.config.namespace, self.config.chunk_tokens
        )
        kv_role = ktc.kv_role or "kv_both"
        can_dump = kv_role in ("kv_both", "kv_producer")
        can_load = kv_role in ("kv_both", "kv_consumer")
        self.store = shared_store(self.config, self.layout.max_value_bytes)
        self._sched_side: Any = None
        self._worker_side: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from ucm_patch.connector.scheduler_side import SchedulerSide

            # Said once, at start (connector/vllm_support.py): a vLLM that cannot give a
            # hybrid model hits leaves the connector idle for it; random hash seeds keep
            # every process's keys apart.
            hybrid_refused = self.layout.mamba_groups and vllm_support.hybrid_unsupported_reason(
                vllm_config,
                hash_block_size=self.layout.hash_block_size,
                state_block_size=max(g.block_size for g in self.layout.mamba_groups),
            )
            if hybrid_refused:
                logger.warning("UCMPatchConnector: %s.", hybrid_refused)
                can_dump = can_load = False
            seed_reason = vllm_support.random_hash_seed_reason(
                hash_algo=getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
            )
            if seed_reason and (can_dump or can_load):
                logger.warning("UCMPatchConnector: %s.", seed_reason)

            self._sched_side = SchedulerSide(
                self.layout,
                self.config,
                self.store,
                can_load=can_load,
                can_dump=can_dump,
                expected_reports=int(getattr(vllm_config.parallel_config, "world_size", 1)),
            )
        else:
            from ucm_patch.connector.worker_side import WorkerSide

            if can_dump:  # its helpers (a local store's cleaner process) start now
                self.store.prepare_writes()

            self._worker_side = WorkerSide(
                self.layout,
                self.config,
                self.store,
                kv_cache_config,
                _tp_rank(self.layout.tp_size),
                can_load=can_load,
                can_dump=can_dump,
                reserve_tokens=int(
                    getattr(getattr(vllm_config, "model_config", None), "max_model_len", 0) or 0
                ),
            )
            # The two per-layer calls go straight to the worker side: one Python frame
            # less per layer per step each (a sizeable share of the per-layer save-path
            # budget, 2 us). The methods below remain the documented API.
            self.wait_for_layer_load = self._worker_side.wait_for_layer_load  # type: ignore[method-assign]
            self.save_kv_layer = self._worker_side.save_kv_layer  # type: ignore[method-assign]
        # Deltas since the last report, for vLLM's connector stats (connector/vllm_metrics.py):
        # each side reports only what it counts itself.
        self._reporter = (
            connector_metrics.scheduler_reporter(self.store)
            if role == KVConnectorRole.SCHEDULER
            else connector_metrics.worker_reporter(self.store)
        )
        logger.info(
            "UCMPatchConnector %s: %s, key fingerprint %s, %d row(s), group(s) %s",
            role.name.lower(),
            self.config.describe(),
            self.layout.fingerprint,
            len(self.layout.rows),
            [f"{g.index}:{g.kind}/{g.block_size}" for g in self.layout.groups],
        )

    # -- capabilities ---------------------------------------------------------------------
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise hooks run between graph pieces: full CUDA graphs would skip them."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped dump is a later miss, never lost output."""
        return False

    # -- metrics (vLLM's KV-connector stats path; see connector/vllm_metrics.py) ----------------
    def get_kv_connector_stats(self) -> Any:
        """This side's counters since the last call (per step), None when nothing changed."""
        data = self._reporter.report()
        return connector_metrics.make_stats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return connector_metrics.make_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """``vllm:ucm_*`` families on the OpenAI server's ``/metrics`` (front-end process)."""
        return connector_metrics.build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def _side(self, side: Any, what: str) -> Any:
        if side is None:
            raise RuntimeError(f"UCMPatchConnector.{what} called on the {self.role.name} role")
        return side

    @property
    def worker_side(self) -> WorkerSide | None:
        """The worker-side half (None in the scheduler role), for benchmarks and
        diagnostics that read or drive it directly."""
        return self._worker_side

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The scheduler-side half (None in the worker role), for benchmarks and
        diagnostics that read or drive it directly."""
        return self._sched_side

    # ==================================================================================
    # Worker side
    # ==================================================================================
    def layer_calls(self) -> dict[str, dict[str, int]]:
        """Worker side: ``{"wait": {layer: calls}, "save": {layer: calls}}`` seen so far
        (which layers the patches or vLLM's own hooks reach; demo and tests)."""
        worker = self._side(self._worker_side, "layer_calls")
        return {"wait": dict(worker.wait_calls), "save": dict(worker.save_calls)}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._side(self._worker_side, "register_kv_caches").register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, UCMConnectorMetadata):
            raise TypeError(
                f"UCMPatchConnector: expected UCMConnectorMetadata, got "
                f"{type(connector_metadata).__name__}"
            )
        self._side(self._worker_side, "bind_connector_metadata").bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM 0.18 passes the preempted ids, 0.19+ this step's metadata.
        if isinstance(kv_connector_metadata, UCMConnectorMetadata):
            ids = kv_connector_metadata.preempted_req_ids
        else:
            ids = set(kv_connector_metadata or ())
        self._side(self._worker_side, "handle_preemptions").handle_preemptions(ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._side(self._worker_side, "start_load_kv").start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Worker role: replaced per instance by the worker side's method (see __init__).
        self._side(self._worker_side, "wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Worker role: replaced per instance by the worker side's method (see __init__).
        self._side(self._worker_side, "save_kv_layer").save_kv_layer(
            layer_name, kv_layer, attn_metadata, **kwargs
        )

    def wait_for_save(self) -> None:
        self._side(self._worker_side, "wait_for_save").wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._side(self._worker_side, "get_finished")
        sending, recving, _failed = worker.transfer_results(
            finished_req_ids, failures_as_block_errors=True
        )
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        worker = self._side(self._worker_side, "get_transfer_results")
        sending, recving, failed = worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._side(
            self._worker_side, "get_block_ids_with_load_errors"
        ).block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker_side.worker_meta() if self._worker_side is not None else None

    def shutdown(self) -> None:
        if self._worker_side is not None:
            self._worker_side.shutdown()

    # ==================================================================================
    # Scheduler side
    # ==================================================================================
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self._side(self._sched_side, "get_num_new_matched_tokens")
        return side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        side = self._side(self._sched_side, "update_state_after_alloc")
        side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._side(self._sched_side, "build_connector_meta").build_connector_meta(
            scheduler_output
        )

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched_side is not None:
            self._sched_side.update_connector_output(connector_output)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._side(self._sched_side, "bind_gpu_block_pool").bind_gpu_block_pool(gpu_block_pool)

    def has_pending_push_work(self) -> bool:
        return self._sched_side is not None and self._sched_side.has_pending_work()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Non-HMA path, incl. vLLM's MultiConnector with a non-HMA sibling: the same
        # decision as request_finished_all_groups, or finished_sending is miscounted.
        return self._side(self._sched_side, "request_finished").request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._side(self._sched_side, "request_finished_all_groups")
        return side.request_finished(request)


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def register_with_vllm() -> bool:
    """Register ``UCMPatchConnector`` with vLLM's connector factory (idempotent).

    Returns True when this call registered it, False when it already was. Called by the
    ucm_patch plugin in every vLLM process.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with _register_lock:
        registry = getattr(KVConnectorFactory, "_registry", None)
        if registry is not None and NAME in registry:
            return False
        try:
            KVConnectorFactory.register_connector(NAME, __name__, NAME)
        except ValueError as exc:  # registered meanwhile by another path
            if "already registered" not in str(exc):
                raise
            return False
        return True


def stats() -> dict[str, float]:
    """This process's connector counters plus the dump scheduler's main ones
    (``dump_work_s``: seconds the dump workers spent copying and storing completed dumps,
    their waits for KV-ready events left out; ``dump_copy_s``: of which copying the pages
    off the device into staging buffers, the rest being the store's puts; ``dump_busy_s``:
    wall seconds with any dump worker at that work, so bytes over it is the dump path's
    bandwidth however many workers share it)."""
    from ucm_patch.hooks.metrics import METRICS

    out = connector_stats.snapshot()
    out["dumps_completed"] = METRICS.dumps_completed
    out["dumps_failed"] = METRICS.dumps_failed
    out["dumps_skipped"] = METRICS.dumps_skipped
    out["dumps_lost"] = METRICS.dumps_lost
    out["bytes_written"] = METRICS.bytes_written
    out["dump_work_s"] = METRICS.dump_duration.total - METRICS.dump_event_wait_s
    out["dump_copy_s"] = METRICS.dump_produce_s
    out["dump_busy_s"] = METRICS.dump_busy_s
    return out


def wait_for_dumps(timeout: float = 30.0) -> bool:
    """Block until this process's dump scheduler has no dump in flight (tests, demo)."""
    from ucm_patch.hooks.dump import get_scheduler

    sched = get_scheduler()
    deadline = time.monotonic() + timeout
    while sched.internal_sizes()["slots_in_use"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def release_finished(llm: Any, timeout: float = 30.0) -> bool:
    """Let an offline ``vllm.LLM`` free the blocks of requests whose dumps outlived them.

    A finished request whose dumps still read its blocks is freed by vLLM only once a
    worker reports it in ``finished_sending``, and that report travels with an engine step.
    vLLM's engine-core process keeps stepping while it holds such requests
    (``Scheduler.has_requests``), so servers need nothing. An in-process engine (``LLM``
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only inside ``generate``: right after
    it returns, ``llm.reset_prefix_cache()`` is False while the last request's blocks are
    held. This waits for this process's dumps and runs empty engine steps until vLLM holds
    no finished request. Returns True once none is held (at once for an engine-core
    process, which releases them by itself), False when ``timeout`` (seconds) ran out.
    """
    engine = getattr(llm, "llm_engine", llm)
    core = getattr(engine.engine_core, "engine_core", None)  # vLLM's InprocClient
    if core is None:
        return True
    scheduler = core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.has_finished_requests():
        if time.monotonic() > deadline:
            return False
        wait_for_dumps(max(0.0, deadline - time.monotonic()))
        engine.step()
    return True


def active_connectors() -> list[UCMPatchConnector]:
    """This process's worker-side UCMPatchConnector(s), also inside a MultiConnector."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    agent = getattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    found: list[UCMPatchConnector] = []
    stack = [agent] if agent is not None else []
    while stack:
        conn = stack.pop()
        if isinstance(conn, UCMPatchConnector):
            found.append(conn)
        stack.extend(getattr(conn, "_connectors", ()))
    return found
