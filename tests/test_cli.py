"""``ucm-patch`` CLI: status (also without vLLM installed) and the generated docs."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env

CLI = str(Path(sys.executable).with_name("ucm-patch"))


def test_status_json_lists_every_record(tmp_path: Path) -> None:
    proc = subprocess.run(
        [CLI, "status", "--json"],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(proc.stdout)
    import ucm_patch.patches

    ids = {r.id for ps in ucm_patch.patches.all_patch_sets() for r in ps.records}
    assert {row["id"] for row in rows} == ids
    for row in rows:
        assert set(row) >= {"id", "target", "requires", "installed", "state", "reason"}


def test_status_imports_targets_on_request(tmp_path: Path) -> None:
    proc = subprocess.run(
        [CLI, "status", "--json", "--import-targets"],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    rows = json.loads(proc.stdout)
    assert not [r for r in rows if r["state"] == "failed"], rows
    # Still waiting only where the module cannot be imported on this platform (the XPU
    # GDN op needs vllm_xpu_kernels), and the CLI said so.
    waiting = {r["target"].partition(":")[0] for r in rows if r["state"] == "waiting-for-import"}
    assert waiting == {"vllm._xpu_ops"}, waiting
    assert "ucm-patch: cannot import vllm._xpu_ops" in proc.stderr


def test_status_reports_bad_configuration_cleanly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [CLI, "status"],
        env=clean_env({"UCM_PATCH_GDN_LAYERWISE": "maybe"}),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "UCM_PATCH_GDN_LAYERWISE='maybe' is not a switch" in proc.stderr


def test_status_with_an_unknown_variable_warns_once_and_reports(tmp_path: Path) -> None:
    """An unknown ``UCM_PATCH_*`` name is not bad configuration (issue #36): one warning
    names it, and the status is the same as without it."""
    proc = subprocess.run(
        [CLI, "status", "--json"],
        env=clean_env({"UCM_PATCH_NOPE": "1"}),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("UCM_PATCH_NOPE") == 1, proc.stderr
    assert json.loads(proc.stdout)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with ucm_patch and its two dependencies only: no vLLM, no torch."""
    root = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    site = next((root / "lib").glob("python3*/site-packages"))
    # Reuse this environment's pip and wheels: no index access needed.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(REPO),
            "wrapt",
            "packaging",
        ],
        check=True,
        env=clean_env(),
        capture_output=True,
    )
    return root


def test_status_works_without_vllm(bare_venv: Path, tmp_path: Path) -> None:
    py = str(bare_venv / "bin" / "python")
    check = subprocess.run([py, "-c", "import vllm"], capture_output=True, cwd=tmp_path)
    assert check.returncode != 0  # really no vLLM here
    proc = subprocess.run(
        [py, "-m", "ucm_patch", "status", "--json"],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(proc.stdout)
    assert rows, "no records"
    vllm_rows = [r for r in rows if "vllm" in r["requires"]]
    assert vllm_rows and all(r["state"] in ("skipped-version", "disabled") for r in vllm_rows)
    assert all(
        "vllm is not installed" in r["reason"] for r in vllm_rows if r["state"] == "skipped-version"
    )
