"""The Grafana dashboard (docs/grafana/ucm_patch_dashboard.json) queries only metrics that
exist, and every ``vllm:ucm_*`` family has a panel (issue #17).

The families are the ones ``ucm_patch.connector.vllm_metrics`` registers (tests/test_e2e_server.py
finds them on a real server's ``/metrics``); vLLM's own families the dashboard puts next
to ours are listed here by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO
from ucm_patch.connector import vllm_metrics as stats

DASHBOARD = REPO / "docs" / "grafana" / "ucm_patch_dashboard.json"
VLLM_FAMILIES = {"vllm:external_prefix_cache_hits"}  # vLLM's own, shown beside ours
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):
        yield panel
        yield from _panels(panel)  # rows nest panels


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def queried(dashboard: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            names |= set(re.findall(r"vllm:[A-Za-z0-9_:]+", target["expr"]))
    return {_family(n) for n in names}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_queried_metric_exists(dashboard: dict[str, Any]) -> None:
    ours = set(stats.family_names())
    unknown = {f for f in queried(dashboard) if f not in ours and f not in VLLM_FAMILIES}
    assert unknown == set()


def test_every_connector_family_has_a_panel(dashboard: dict[str, Any]) -> None:
    assert set(stats.family_names()) - queried(dashboard) == set()


def test_counters_are_queried_as_rates_of_their_total(dashboard: dict[str, Any]) -> None:
    counters = {f"{stats.PREFIX}{name}" for name in stats.COUNTERS}
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            for name in re.findall(r"vllm:[A-Za-z0-9_:]+", target["expr"]):
                if _family(name) in counters:
                    assert name.endswith("_total") and "rate(" in target["expr"], target


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)) and ids
    assert dashboard["title"] and dashboard["uid"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name"} <= variables
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            assert 'model_name="$model_name"' in target["expr"], target["expr"]


def test_a_misspelt_metric_is_caught() -> None:
    bad = {"panels": [{"id": 1, "targets": [{"expr": "rate(vllm:ucm_dump_byte_total[1m])"}]}]}
    assert "vllm:ucm_dump_byte" in queried(bad) - set(stats.family_names())
