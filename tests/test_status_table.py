"""``ucm-patch status`` in a terminal: 100 columns by default, ``--wide``, ``--state``, colour.

The rows are the real registry report of this installation (every record, in the states
this process gives them), so a long new target or reason cannot break the width.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env
from ucm_patch import status_table as table

CLI = str(Path(sys.executable).with_name("ucm-patch"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "status", *args], env=clean_env(), capture_output=True, text=True)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_default_table_fits_100_columns_and_shows_every_record(rows):
    text = table.format_table(rows)
    assert max(len(line) for line in text.splitlines()) <= 100
    for row in rows:
        name, _, era = row["id"].partition("@")
        assert f"\n{name}\n" in f"\n{text}\n"  # the patch heading
        assert any(line.startswith(f"  {era} ") for line in text.splitlines()), era


def test_reasons_where_they_explain_something(rows):
    failed = {**rows[0], "state": "failed", "reason": "signature changed: expected (a), " * 9}
    text = table.format_table([failed])
    reason_line = text.splitlines()[-1]
    assert reason_line.startswith("      signature changed") and reason_line.endswith("…")
    assert len(reason_line) == 100
    skipped = {**rows[0], "state": "skipped-version", "reason": "vllm 0.32 is outside"}
    assert "outside" not in table.format_table([skipped])


def test_wide_table_has_every_column_in_full(rows):
    text = table.format_table(rows, wide=True)
    header = text.splitlines()[0].split()
    assert header == [c.upper() for c in table.WIDE_COLUMNS]
    assert all(row["target"] in text for row in rows)
    assert max(len(line) for line in text.splitlines()) > 100  # why it is not the default


def test_colour_only_when_asked(rows):
    applied = {**rows[0], "state": "applied", "reason": ""}
    assert "\033[" not in table.format_table([applied])
    coloured = table.format_table([applied], color=True)
    assert f"{table.STATE_COLOURS['applied']}applied" in coloured


def test_state_filter_and_json_unchanged(rows):
    states = {r["state"] for r in rows}
    pick = sorted(states)[0]
    proc = _run("--json", "--state", pick)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [r for r in rows if r["state"] == pick]
    proc = _run("--state", f"{pick},failed")
    assert proc.returncode == 0
    shown = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert len(shown) == sum(r["state"] in (pick, "failed") for r in rows)


def test_unknown_state_is_a_clear_error():
    proc = _run("--state", "aplied")
    assert proc.returncode == 2
    assert "--state aplied: not a record state" in proc.stderr and "'applied'" in proc.stderr
