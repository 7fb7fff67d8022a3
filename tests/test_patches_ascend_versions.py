"""Gating of the vLLM-Ascend records: vLLM-Ascend X pairs vLLM X, and on a mismatch vLLM wins.

The installed vLLM-Ascend version comes from distribution metadata: the stand-in era folders
carry a ``vllm_ascend-<version>.dist-info``, found by ``importlib.metadata`` once the folder
is on ``sys.path``. ``UCM_PATCH_VLLM_VERSION`` plays the installed vLLM. Gating reads
metadata only: nothing is imported, so each case is a quick child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import REPO, clean_env

STANDINS = REPO / "tests" / "standins"
REPORT = """
import json
from ucm_patch.patches.vllm_ascend import PATCH_SETS
from ucm_patch.registry import Registry
registry = Registry([r for ps in PATCH_SETS for r in ps.records])
registry.activate(env={})
print("UCM_RESULT " + json.dumps(registry.report()))
"""


def report(era: str | None, **env: str) -> dict[str, dict[str, Any]]:
    extra = {"UCM_PATCH": "0", **env}
    if era:
        extra["PYTHONPATH"] = str(STANDINS / era)
    proc = subprocess.run(
        [sys.executable, "-c", REPORT],
        cwd=REPO,
        env=clean_env(extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("UCM_RESULT ")]
    return {row["id"]: row for row in json.loads(line.removeprefix("UCM_RESULT "))}


def in_range(rows: dict[str, dict[str, Any]]) -> set[str]:
    return {rid for rid, row in rows.items() if row["state"] == "waiting-for-import"}


def test_paired_versions_gate_as_reported() -> None:
    rows = report("ascend_0_18", UCM_PATCH_VLLM_VERSION="0.18.1")
    assert "gdn_layerwise@ascend-0.18" in in_range(rows)
    assert "gdn_layerwise@ascend-0.21" not in in_range(rows)
    assert rows["gdn_layerwise@ascend-0.18"]["installed"]["vllm-ascend"] == "0.18.0"


def test_stale_vllm_ascend_version_is_gated_as_the_installed_vllm() -> None:
    # A nightly image: vLLM 0.23 with a vLLM-Ascend that still reports 0.18.0.
    rows = report("ascend_0_18", UCM_PATCH_VLLM_VERSION="0.23.0")
    live = in_range(rows)
    assert {
        "gdn_layerwise@ascend-0.19",
        "gdn_layerwise@ascend-0.21",
        "reshape_cache_event@ascend-0.23-dsa",
    } <= live
    assert "gdn_layerwise@ascend-0.18" not in live and "ascend_sfa_wait@ascend-0.13" not in live
    shown = rows["gdn_layerwise@ascend-0.18"]["installed"]["vllm-ascend"]
    assert shown.startswith(
        "0.18.0 (gated as 0.23.0); mismatch: vllm-ascend reports 0.18.0 but vllm is 0.23.0"
    )
    assert "outside the required range" in rows["gdn_layerwise@ascend-0.18"]["reason"]


def test_explicit_vllm_ascend_override_is_not_aligned() -> None:
    rows = report(
        "ascend_0_18", UCM_PATCH_VLLM_VERSION="0.23.0", UCM_PATCH_VLLM_ASCEND_VERSION="0.18.0"
    )
    assert "gdn_layerwise@ascend-0.18" in in_range(rows)
    assert "gdn_layerwise@ascend-0.21" not in in_range(rows)
    assert "mismatch" not in rows["gdn_layerwise@ascend-0.18"]["installed"]["vllm-ascend"]


def test_post_and_rc_releases_gate_as_their_base_release() -> None:
    rows = report(
        None, UCM_PATCH_VLLM_VERSION="0.23.0", UCM_PATCH_VLLM_ASCEND_VERSION="0.23.0.post1"
    )
    assert "reshape_cache_event@ascend-0.23-dsa" in in_range(rows)
    rows = report(None, UCM_PATCH_VLLM_VERSION="0.19.1", UCM_PATCH_VLLM_ASCEND_VERSION="0.19.1rc1")
    assert "gdn_layerwise@ascend-0.19" in in_range(
        rows
    ) and "ascend_sfa_wait@ascend-0.13" not in in_range(rows)


def test_without_vllm_ascend_nothing_is_in_range() -> None:
    rows = report(None)
    assert in_range(rows) == set()
    assert all(row["reason"] == "vllm-ascend is not installed" for row in rows.values())


def test_status_command_shows_the_mismatch() -> None:
    env = clean_env(
        {"PYTHONPATH": str(STANDINS / "ascend_0_18"), "UCM_PATCH_VLLM_VERSION": "0.23.0"}
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_patch", "status", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {row["id"]: row for row in json.loads(proc.stdout)}
    shown = rows["gdn_layerwise@ascend-0.21"]["installed"]["vllm-ascend"]
    assert "0.18.0 (gated as 0.23.0); mismatch" in shown
    assert rows["gdn_layerwise@ascend-0.21"]["state"] == "waiting-for-import"
