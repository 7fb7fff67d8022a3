"""How the store benchmark turns rates into shares of memcpy (``bench_common.memcpy_share``).

A share is what the store targets of issue #27 are judged on, so its arithmetic is tested:
paired per round when the bench measured a memcpy right before each round, else against
the run's memcpy median.
"""

from __future__ import annotations

import pytest

from tests.support import load_script

bc = load_script("bench_common")


def test_paired_rounds_give_the_median_of_their_ratios() -> None:
    # the host slows down by half in round 2: store and memcpy both see it
    ops = {"put": [600.0, 300.0, 620.0], "memcpy_put": [1000.0, 500.0, 1000.0]}
    assert bc.memcpy_share(ops, "put", ceiling=2000.0) == pytest.approx(0.6)


def test_unpaired_rates_use_the_run_ceiling() -> None:
    ops = {"put": [300.0, 500.0, 400.0]}
    assert bc.memcpy_share(ops, "put", ceiling=1000.0) == pytest.approx(0.4)
    # a pairing list of another length is not a pairing
    ops["memcpy_put"] = [1000.0]
    assert bc.memcpy_share(ops, "put", ceiling=1000.0) == pytest.approx(0.4)


def test_missing_rates_or_ceiling_give_none() -> None:
    assert bc.memcpy_share({}, "put", ceiling=1000.0) is None
    assert bc.memcpy_share({"put": [1.0]}, "put", ceiling=None) is None
