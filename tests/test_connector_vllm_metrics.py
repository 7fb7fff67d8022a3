"""The connector's stats for vLLM's KV-connector stats path, without a server.

Deltas per side, aggregation across workers and intervals (counters add, gauges take the
max, duration samples concatenate), vLLM's log summary, the Prometheus families built
with vLLM's own metric classes into a fresh registry, and pickling (vLLM sends the stats
from worker processes to the engine core). tests/test_e2e_server.py checks the same
families on a real server's ``/metrics``.
"""

from __future__ import annotations

import pickle
from typing import Any

import prometheus_client
import pytest

from ucm_patch.connector import counters
from ucm_patch.connector import vllm_metrics as cs
from ucm_patch.hooks import metrics as dm


class Store:
    def __init__(self) -> None:
        self.stats = {"bytes_read": 0}
        self.used_bytes = 100
        self.capacity_bytes = 1000


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setattr(dm, "METRICS", dm.DumpMetrics())
    counters.reset()
    return Store()


def test_worker_reports_deltas_and_nothing_when_idle(fresh: Store) -> None:
    rep = cs.worker_reporter(fresh)
    assert rep.report() is None
    dm.METRICS.dumps_submitted += 3
    dm.METRICS.dumps_completed += 2
    dm.METRICS.bytes_written += 4096
    dm.METRICS.dump_durations.extend([0.001, 0.002])
    fresh.stats["bytes_read"] += 512
    counters.bump("load_errors")
    data = rep.report()
    assert data == {
        "dumps_submitted": 3,
        "dumps_completed": 2,
        "dump_bytes": 4096,
        "load_bytes": 512,
        "load_errors": 1,
        "dump_durations": [0.001, 0.002],
        "store_used_bytes": 100,
        "store_capacity_bytes": 1000,
    }
    assert dm.METRICS.dump_durations == []  # drained
    assert rep.report() is None  # no change since


def test_scheduler_reports_only_its_own_counters(fresh: Store) -> None:
    rep = cs.scheduler_reporter(fresh)
    counters.bump("lookups", 2)
    counters.bump("hit_tokens", 256)
    dm.METRICS.dumps_submitted += 5  # the worker side's, in the same process
    assert rep.report() == {"lookups": 2, "hit_tokens": 256}


def test_aggregate_adds_counters_maxes_gauges_joins_samples() -> None:
    a = cs.make_stats({"dumps_completed": 2, "store_used_bytes": 10, "dump_durations": [0.1]})
    b = cs.make_stats({"dumps_completed": 3, "store_used_bytes": 7, "dump_durations": [0.3]})
    merged = a.aggregate(b)
    assert merged.data == {
        "dumps_completed": 5,
        "store_used_bytes": 10,
        "dump_durations": [0.1, 0.3],
    }
    summary = merged.reduce()
    assert summary["dumps_completed"] == 5 and summary["dump_ms_avg"] == 200.0
    assert not merged.is_empty() and cs.make_stats(None).is_empty()


def test_stats_cross_process_boundaries() -> None:
    stats = cs.make_stats({"hit_tokens": 128, "dump_durations": [0.5]})
    assert pickle.loads(pickle.dumps(stats)).data == stats.data


def test_prometheus_families_with_vllms_labels() -> None:
    registry = prometheus_client.CollectorRegistry()

    def bind(cls: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            return cls(*args, registry=registry, **kwargs)

        return make

    types = {
        prometheus_client.Counter: bind(prometheus_client.Counter),
        prometheus_client.Gauge: bind(prometheus_client.Gauge),
        prometheus_client.Histogram: bind(prometheus_client.Histogram),
    }

    class Config:
        kv_transfer_config = None

    prom = cs.build_prom_metrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"dumps_completed": 4, "store_used_bytes": 9, "dump_durations": [0.002, 0.2]})
    prom.observe({"dumps_completed": 1, "store_used_bytes": 5})

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0"})

    assert sample("vllm:ucm_dumps_completed_total") == 5
    assert sample("vllm:ucm_store_used_bytes") == 5  # a gauge: the latest
    assert sample("vllm:ucm_dump_duration_seconds_count") == 2
    assert sample("vllm:ucm_dump_duration_seconds_sum") == pytest.approx(0.202)
    names = {m.name for m in registry.collect()}
    for family in cs.family_names():
        assert family.removesuffix("_total") in names or family in names, family
