"""The connector's metrics through vLLM's own KV-connector stats path (``vllm:ucm_*``).

How vLLM moves connector stats (0.32, ``kv_connector/v1/metrics.py``): every step the
model runner asks the worker's connector ``get_kv_connector_stats()``; the scheduler
aggregates the workers' answers and its own connector's (``KVConnectorStats.aggregate``)
into ``SchedulerStats.kv_connector_stats`` (a dict: ``to_dict()``), which reaches the
front-end process. There ``KVConnectorLogging`` logs it at the logging interval and
``KVConnectorProm`` hands it to the metrics class the connector built with
``build_prom_metrics`` in that process: the OpenAI server's ``GET /metrics`` then carries
our families with vLLM's labels (``model_name``, ``engine``).

So each side reports what only it knows, as *deltas since its last report*, and returns
None when nothing changed (no payload on idle steps): the scheduler side its lookups and
hit tokens, the worker side dumps, loads, bytes, events and the store. Gauges (store
used / capacity) travel as the latest value and aggregate by max (workers of one host
share one local store). Dump durations travel as samples (bounded by
``hooks.metrics.DURATION_SAMPLES_MAX`` per step), so the Prometheus histogram is exact.

``hooks/metrics.py`` keeps the ``ucm_patch_*`` collector for use outside vLLM (the demo and
the benchmarks read it in-process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ucm_patch.connector import counters
from ucm_patch.hooks import metrics as dump_metrics

#: counter name -> its Prometheus documentation (`vllm:ucm_<name>_total` on /metrics)
COUNTERS: dict[str, str] = {
    "dumps_submitted": "Layer dumps handed to the dump scheduler.",
    "dumps_completed": "Layer dumps whose every page was stored.",
    "dumps_failed": "Layer dumps that failed (store, event or payload error; store full).",
    "dumps_skipped": "Layer dumps never queued (back-pressure or shutdown).",
    "dump_bytes": "Bytes stored by completed dumps.",
    "load_bytes": "Bytes read from the store into the KV cache.",
    "hit_tokens": "Prompt tokens served from the store (external prefix-cache hits).",
    "lookups": "Store lookups made by the scheduler.",
    "load_errors": "Pages that failed to load (the blocks are recomputed).",
    "kv_events_recorded": "Dumps that waited on a recorded KV-ready event.",
    "kv_events_missing": "Dumps where a KV-ready event was expected and absent.",
    "kv_events_failed": "Dumps whose event could not be used (handle or record failed).",
}
GAUGES: dict[str, str] = {
    "store_used_bytes": "Bytes the store holds.",
    "store_capacity_bytes": "Bytes the store may hold.",
}
DURATIONS = "dump_durations"
HISTOGRAM = ("dump_duration_seconds", "Time a dump worker spent on one completed layer dump.")
PREFIX = "vllm:ucm_"
SCHEDULER_COUNTERS = ("lookups", "hit_tokens")
# Event sources that are a recorded event (not "none", "current_stream", "device_sync").
_RECORDED = tuple(
    i
    for i, name in enumerate(dump_metrics.EVENT_SOURCE_NAMES)
    if name in ("reshape_cache_layer", "reshape_cache_direct", "kv_ready_table", "external")
)


def _worker_totals(store: Any) -> dict[str, int]:
    """This process's cumulative worker-side values (read per step, never per layer)."""
    m = dump_metrics.METRICS
    m.refresh()  # the scheduler's lock-free submit counts, folded in
    c = counters.snapshot()
    sources = m.event_sources
    return {
        "dumps_submitted": m.dumps_submitted,
        "dumps_completed": m.dumps_completed,
        "dumps_failed": m.dumps_failed,
        "dumps_skipped": m.dumps_skipped,
        "dump_bytes": m.bytes_written,
        "load_bytes": int(store.stats.get("bytes_read", 0)),
        "load_errors": c["load_errors"],
        "kv_events_recorded": sum(sources[i] for i in _RECORDED),
        "kv_events_missing": m.event_expected_missing,
        "kv_events_failed": m.event_handle_failed + m.event_record_failed,
    }


def _scheduler_totals(store: Any) -> dict[str, int]:
    c = counters.snapshot()
    return {name: c[name] for name in SCHEDULER_COUNTERS}


class DeltaReporter:
    """Turns one side's cumulative totals into per-report deltas (one per connector)."""

    def __init__(self, totals: Callable[[Any], dict[str, int]], store: Any, gauges: bool) -> None:
        self._totals = totals
        self._store = store
        self._gauges = gauges
        self._last = totals(store)  # start from now: earlier activity is not ours

    def report(self) -> dict[str, Any] | None:
        now = self._totals(self._store)
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        data: dict[str, Any] = {k: v for k, v in delta.items() if v}
        if self._gauges:
            samples = dump_metrics.METRICS.dump_durations
            if samples:
                # Swap, not copy: the scheduler appends under its lock on this thread's
                # retire path; a sample racing the swap lands in the next report.
                dump_metrics.METRICS.dump_durations = []
                data[DURATIONS] = samples
            if data:
                data.update(store_gauges(self._store))
        return data or None


def store_gauges(store: Any) -> dict[str, int]:
    used = getattr(store, "used_bytes", None)
    capacity = getattr(store, "capacity_bytes", None)
    out: dict[str, int] = {}
    if isinstance(used, int):
        out["store_used_bytes"] = used
    if isinstance(capacity, int):
        out["store_capacity_bytes"] = capacity
    return out


def worker_reporter(store: Any) -> DeltaReporter:
    return DeltaReporter(_worker_totals, store, gauges=True)


def scheduler_reporter(store: Any) -> DeltaReporter:
    return DeltaReporter(_scheduler_totals, store, gauges=False)


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two reports as one: counters add, gauges take the max, samples concatenate."""
    out: dict[str, Any] = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = list(value) if key == DURATIONS else value
        elif key == DURATIONS:
            out[key] = [*out[key], *value]
        elif key in GAUGES:
            out[key] = max(out[key], value)
        else:
            out[key] = out[key] + value
    return out


try:  # vLLM >= 0.11.1: the KV-connector stats path
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats as _StatsBase,
    )
except ImportError:  # pragma: no cover - older vLLM: nobody asks for stats

    @dataclasses.dataclass
    class _StatsBase:  # type: ignore[no-redef]
        data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class UCMConnectorStats(_StatsBase):
    """ucm_patch's connector stats: deltas since the last report (module docstring).

    Module level: vLLM pickles it from the worker processes to the engine core.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> UCMConnectorStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's periodic "KV Transfer metrics" line."""
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in _LOGGED}
        samples = self.data.get(DURATIONS) or []
        if samples:
            out["dump_ms_avg"] = round(1000 * sum(samples) / len(samples), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


_LOGGED = ("dumps_completed", "dumps_failed", "dump_bytes", "load_bytes", "hit_tokens")


def make_stats(data: dict[str, Any] | None) -> UCMConnectorStats:
    return UCMConnectorStats(data=dict(data or {}))


def build_prom_metrics(
    vllm_config: Any,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Any:
    """The ``KVConnectorPromMetrics`` of ``vllm:ucm_*`` families (front-end process)."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class UCMPromMetrics(KVConnectorPromMetrics):
        """``vllm:ucm_*`` counters, gauges and the dump-duration histogram, per engine."""

        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            per_engine = self.per_engine_labelvalues
            self.counters = {
                name: create_metric_per_engine(
                    metric_types[Counter](
                        name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames
                    ),
                    per_engine,
                )
                for name, doc in COUNTERS.items()
            }
            self.gauges = {
                name: create_metric_per_engine(
                    metric_types[Gauge](
                        name=f"{PREFIX}{name}",
                        documentation=doc,
                        labelnames=labelnames,
                        multiprocess_mode="mostrecent",
                    ),
                    per_engine,
                )
                for name, doc in GAUGES.items()
            }
            name, doc = HISTOGRAM
            self.histogram = create_metric_per_engine(
                metric_types[Histogram](
                    name=f"{PREFIX}{name}",
                    documentation=doc,
                    buckets=list(dump_metrics.WAIT_BUCKETS),
                    labelnames=labelnames,
                ),
                per_engine,
            )

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, value in transfer_stats_data.items():
                if name in self.counters:
                    self.counters[name][engine_idx].inc(value)
                elif name in self.gauges:
                    self.gauges[name][engine_idx].set(value)
                elif name == DURATIONS:
                    hist = self.histogram[engine_idx]
                    for seconds in value:
                        hist.observe(seconds)

    return UCMPromMetrics()


def family_names() -> list[str]:
    """Every ``/metrics`` family name this module creates (Prometheus adds ``_total`` to
    counters in the exposition): for the dashboard test and docs."""
    return sorted([f"{PREFIX}{n}" for n in (*COUNTERS, *GAUGES)] + [f"{PREFIX}{HISTOGRAM[0]}"])
