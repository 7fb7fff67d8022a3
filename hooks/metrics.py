"""Dump-scheduler metrics: plain ints always, Prometheus families when prometheus_client exists.

Why plain ints first: the save path runs once per layer per step with a 2 µs budget, and a
``prometheus_client.Counter.inc()`` takes a lock and costs about a microsecond. So the
scheduler bumps plain attributes (under the lock it already holds) and Prometheus reads
them only at scrape time through a custom collector (:func:`export`), which yields
Counter / Gauge / Histogram families named ``ucm_patch_*``. Nothing is imported from
prometheus_client unless :func:`export` is called.

Writers: :class:`ucm_patch.hooks.dump.DumpScheduler` (under its lock) and
:class:`ucm_patch.hooks.events.EventLedger` (event sources). Readers may read without a
lock: each value is one int/float read, so a scrape sees every counter at some recent
moment (not an atomic snapshot across counters, which Prometheus does not need).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

#: Event-source labels, indexed by :class:`ucm_patch.hooks.events.EventSource` values.
EVENT_SOURCE_NAMES: tuple[str, ...] = (
    "none",  # host data, nothing to wait for
    "reshape_cache_layer",  # attn_metadata[layer].reshape_cache_event
    "reshape_cache_direct",  # attn_metadata.reshape_cache_event
    "kv_ready_table",  # ucm_patch.hooks.layerwise.kv_ready_events[layer]
    "current_stream",  # owned event recorded on the current stream
    "device_sync",  # no event: the worker synchronises the device
    "external",  # the caller supplied the event
)

#: Most dump-duration samples kept between two drains (the rest only reach the histogram).
DURATION_SAMPLES_MAX = 8192

#: Upper bounds (seconds) of the request wait-for-dump histogram buckets.
WAIT_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Histogram:
    """A fixed-bucket histogram of plain numbers (Prometheus semantics, non-cumulative)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = WAIT_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs including ``+Inf``, as Prometheus wants."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class DumpMetrics:
    """Every counter of one dump scheduler (plain ints; see the module docstring)."""

    __slots__ = (
        "bytes_written",
        "dump_busy_s",
        "dump_duration",
        "dump_durations",
        "dump_event_wait_s",
        "dump_produce_s",
        "dumps_cancelled",
        "dumps_completed",
        "dumps_failed",
        "dumps_lost",
        "dumps_skipped",
        "dumps_store_full",
        "dumps_submitted",
        "event_expected_missing",
        "event_handle_failed",
        "event_record_failed",
        "event_sources",
        "live_handles",
        "preempt_wait",
        "queue_depth",
        "queue_depth_max",
        "refresh",
        "request_wait",
        "requests_failed",
        "requests_finished",
        "worker_errors",
    )

    def __init__(self) -> None:
        self.dumps_submitted = 0
        self.dumps_completed = 0  # every key stored (or already present)
        self.dumps_failed = 0  # store error, payload error, event error, store full
        self.dumps_store_full = 0  # subset of failed: put_many returned False for a key
        self.dumps_skipped = 0  # never queued: no free slot (back-pressure) or shut down
        self.dumps_cancelled = 0  # queued, then dropped unrun by shutdown
        self.dumps_lost = 0  # cancelled or still running when a shutdown flush ran out
        # Invariant: submitted == completed + failed + cancelled + queue_depth.
        self.bytes_written = 0
        self.queue_depth = 0  # tasks taken from the slot pool and not yet finished
        self.queue_depth_max = 0
        self.requests_finished = 0  # reported as finished_sending
        self.requests_failed = 0  # reported, but at least one dump failed or was skipped
        self.worker_errors = 0  # unexpected exceptions caught at the worker thread boundary
        self.event_sources = [0] * len(EVENT_SOURCE_NAMES)
        self.event_expected_missing = 0  # KV-ready event expected, none found
        self.event_handle_failed = 0  # raw handle extraction failed, fell back
        self.event_record_failed = 0  # current-stream record failed, fell back to sync
        self.request_wait = Histogram()  # finished -> all dumps done (seconds)
        self.dump_duration = Histogram()  # one completed dump task in a worker (seconds)
        # The same durations as samples, drained by the KV connector's per-step stats for
        # vLLM's Prometheus histogram (bounded: DURATION_SAMPLES_MAX between two drains).
        self.dump_durations: list[float] = []
        # Of the completed dumps' durations, the seconds spent waiting for their KV-ready
        # events: the rest is the dump path's own work (bandwidth = bytes / that rest).
        self.dump_event_wait_s = 0.0
        # ... and the seconds their payload callables ran (the connector's device copy):
        # the rest of the work is the store's put
        self.dump_produce_s = 0.0
        # Wall seconds during which at least one worker was past its task's event wait
        # (copying, putting): bytes over it is what the dump path absorbs while it works,
        # however many workers share it (the sums above count each worker's seconds).
        self.dump_busy_s = 0.0
        self.preempt_wait = Histogram()  # handle_preemptions blocking time (seconds)
        #: Callable returning (live owned, live borrowed) handles; set by the ledger.
        self.live_handles: Callable[[], tuple[int, int]] = _no_handles
        #: Callable that brings the counters up to date before they are read: the dump
        #: scheduler's (it folds its lock-free per-client submit counts); set by it.
        self.refresh: Callable[[], None] = _nothing

    def snapshot(self) -> dict[str, Any]:
        """All values as a plain dict (for tests, benchmarks and reports)."""
        self.refresh()
        owned, borrowed = self.live_handles()
        out: dict[str, Any] = {
            name: getattr(self, name)
            for name in self.__slots__
            if name
            not in (
                "event_sources",
                "request_wait",
                "preempt_wait",
                "dump_duration",
                "dump_durations",
                "live_handles",
                "refresh",
            )
        }
        out["event_sources"] = dict(zip(EVENT_SOURCE_NAMES, self.event_sources, strict=True))
        out["live_owned_handles"] = owned
        out["live_borrowed_handles"] = borrowed
        out["request_wait_count"] = self.request_wait.count
        out["request_wait_sum_s"] = self.request_wait.total
        out["dump_duration_count"] = self.dump_duration.count
        out["dump_duration_sum_s"] = self.dump_duration.total
        out["preempt_wait_count"] = self.preempt_wait.count
        out["preempt_wait_sum_s"] = self.preempt_wait.total
        return out


def _no_handles() -> tuple[int, int]:
    return (0, 0)


def _nothing() -> None:
    return None


#: The process-wide metrics object the per-worker scheduler singleton uses.
METRICS = DumpMetrics()

_exported: set[int] = set()


def export(metrics: DumpMetrics | None = None, registry: Any = None) -> bool:
    """Expose ``metrics`` (default :data:`METRICS`) to Prometheus; False without the library.

    Idempotent per registry. Uses prometheus_client's default ``REGISTRY`` unless one is
    given (tests pass a fresh ``CollectorRegistry``).
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    reg = REGISTRY if registry is None else registry
    if id(reg) in _exported and registry is None:
        return True
    reg.register(_Collector(METRICS if metrics is None else metrics))
    if registry is None:
        _exported.add(id(reg))
    return True


class _Collector:
    """prometheus_client custom collector reading :class:`DumpMetrics` at scrape time."""

    def __init__(self, metrics: DumpMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []  # no describe-time collection; names are fixed and unique

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        self.m.refresh()

        m = self.m
        counters = (
            ("dumps_submitted", "Dump tasks accepted by the scheduler", m.dumps_submitted),
            ("dumps_completed", "Dump tasks whose every key was stored", m.dumps_completed),
            ("dumps_failed", "Dump tasks that failed (store/event/payload)", m.dumps_failed),
            ("dumps_store_full", "Dump tasks the store skipped as full", m.dumps_store_full),
            ("dumps_skipped", "Dumps never queued (back-pressure/shutdown)", m.dumps_skipped),
            ("dumps_cancelled", "Queued dumps dropped by shutdown", m.dumps_cancelled),
            (
                "dumps_lost",
                "Dumps lost at shutdown (flush bound reached)",
                m.dumps_lost,
            ),
            ("dump_bytes", "Bytes of dump tasks that completed", m.bytes_written),
            ("dump_requests_finished", "Requests reported finished_sending", m.requests_finished),
            ("dump_requests_failed", "Reported requests with a failed dump", m.requests_failed),
            ("dump_worker_errors", "Unexpected errors in dump workers", m.worker_errors),
            (
                "dump_event_expected_missing",
                "Dumps where a KV-ready event was expected but missing",
                m.event_expected_missing,
            ),
            (
                "dump_event_handle_failed",
                "Dumps whose event handle extraction failed",
                m.event_handle_failed,
            ),
            (
                "dump_event_record_failed",
                "Dumps whose current-stream event could not be recorded",
                m.event_record_failed,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"ucm_patch_{name}", doc, value=value)
        src = CounterMetricFamily(
            "ucm_patch_dump_event_source", "Event source chosen per dump", labels=["source"]
        )
        for label, value in zip(EVENT_SOURCE_NAMES, m.event_sources, strict=True):
            src.add_metric([label], value)
        yield src
        yield GaugeMetricFamily(
            "ucm_patch_dump_queue_depth", "Dump tasks in flight", value=m.queue_depth
        )
        yield GaugeMetricFamily(
            "ucm_patch_dump_queue_depth_max", "Most dump tasks in flight", value=m.queue_depth_max
        )
        owned, borrowed = m.live_handles()
        live = GaugeMetricFamily(
            "ucm_patch_dump_live_event_handles",
            "Event handles held by dump tasks",
            labels=["ownership"],
        )
        live.add_metric(["owned"], owned)
        live.add_metric(["borrowed"], borrowed)
        yield live
        for name, doc, hist in (
            (
                "request_dump_wait_seconds",
                "Time from request finished to all its dumps done",
                m.request_wait,
            ),
            (
                "preemption_dump_wait_seconds",
                "Time handle_preemptions blocked on dumps",
                m.preempt_wait,
            ),
            ("dump_duration_seconds", "Time a worker spent on one completed dump", m.dump_duration),
        ):
            yield HistogramMetricFamily(
                f"ucm_patch_{name}", doc, buckets=hist.cumulative(), sum_value=hist.total
            )
