"""The benchmark scripts that stand in for the product still run against it.

``make bench`` is not part of CI (it takes a quiet machine), so a script that drifts from
the code it drives (a stub with an old signature in place of ``make_store``) was only
found by the next full run. Each script here runs its smallest variant into a temporary
results folder, and must exit 0 and write its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "args", "result"),
    [("bench_dump_hook.py", ["--steps", "3"], "dump_hook.json")],
)
def test_a_benchmark_script_runs(tmp_path: Path, script: str, args: list[str], result: str) -> None:
    env = {**os.environ, "UCM_BENCH_RESULTS": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / result).read_text())
