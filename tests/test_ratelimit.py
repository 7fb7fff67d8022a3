"""RateLimitedLog: one line per cause per interval, suppressed lines counted."""

from __future__ import annotations

import logging
import math

import pytest

from ucm_patch.hooks.ratelimit import RateLimitedLog


def test_one_line_per_cause_then_suppressed_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("ucm_patch.hooks.ratelimit.time.monotonic", lambda: clock[0])
    limited = RateLimitedLog(logging.getLogger("ucm_patch.test.ratelimit"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="ucm_patch.test.ratelimit"):
        written = [limited.warning("ENOSPC", "disk full on row %d", row) for row in range(50)]
        assert limited.warning("EIO", "io error")  # another cause is not held back
        clock[0] += 10.0
        assert limited.warning("ENOSPC", "disk full on row %d", 7)
    assert written == [True] + [False] * 49
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "disk full on row 0",
        "io error",
        "disk full on row 7 (49 similar message(s) suppressed in the last 10 s)",
    ]
    assert limited.counts == {"ENOSPC": 51, "EIO": 1}


def test_infinite_interval_logs_each_cause_once(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("ucm_patch.test.ratelimit"), interval_s=math.inf)
    with caplog.at_level(logging.ERROR, logger="ucm_patch.test.ratelimit"):
        for _ in range(5):
            limited.error(RuntimeError, "load raised")
            limited.error(ValueError, "bad shape")
    assert [r.getMessage() for r in caplog.records] == ["load raised", "bad shape"]


def test_bad_interval_names_it() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        RateLimitedLog(logging.getLogger("x"), interval_s=0)
