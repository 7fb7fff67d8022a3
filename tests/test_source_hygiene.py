"""Comments speak the repository's own terms, and one idiom lives in one place.

* No code file cites a document the repository does not hold (planning notes, reference
  write-ups, issue numbers of a tracker that is not in the tree): a reader of the code
  cannot follow such a pointer. Upstream projects are cited by their own PR / issue
  numbers (``vLLM #1234``, ``UCM #989``), which stay valid.
* No package module writes one machine's timings into its comments: they go stale and
  mislead on the next machine; measured figures live in docs/BENCHMARKS.md, rendered from
  a benchmark run. Any number with a time or bandwidth unit (ns, µs, ms, GB/s, MiB/s ...)
  counts, unless its line states a requirement: budgets (``a 2 µs budget per layer``),
  targets and limits stay.
* ``TYPE_CHECKING`` is defined once, in :mod:`ucm_patch.typing_guard`, which says why.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("ucm_patch", "patches", "hooks", "scripts", "tests")
PACKAGE_DIRS = ("ucm_patch", "patches", "hooks")

OUTSIDE_DOCS = re.compile(
    r"targets\.md|ucm-lessons|peers\.md|cpu-vllm\.md|design\.md|/work/shared|"
    r"shared/reference|\bseed \d+|\bissues? \d+\b",
    re.IGNORECASE,
)
# A number with a time or bandwidth unit, on a line that does not state a requirement
# (a budget, target, goal or limit is one, and stays).
MACHINE_TIMING = re.compile(
    r"^(?!.*(?:budget|target|goal|limit|at most|<=|≤)).*?"
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|[KMG]i?B/s)(?![\w/])"
    r"|development VM|\b\d+-core (?:VM|machine)",
    re.IGNORECASE,
)
THIS_FILE = Path(__file__).resolve()


def _files(dirs: tuple[str, ...]) -> list[Path]:
    found = []
    for d in dirs:
        found += [p for p in sorted((REPO / d).rglob("*.py")) if p.resolve() != THIS_FILE]
    return found


def _hits(paths: list[Path], pattern: re.Pattern[str]) -> list[str]:
    out = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                out.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    return out


def test_no_code_cites_documents_outside_the_repository():
    assert _hits(_files(CODE_DIRS), OUTSIDE_DOCS) == []


def test_no_package_comment_carries_one_machines_timings():
    assert _hits(_files(PACKAGE_DIRS), MACHINE_TIMING) == []


def test_type_checking_is_defined_in_one_place():
    defined = re.compile(r"^TYPE_CHECKING\s*=", re.MULTILINE)
    places = [str(p.relative_to(REPO)) for p in _files(CODE_DIRS) if defined.search(p.read_text())]
    assert places == ["ucm_patch/typing_guard.py"]


@pytest.mark.parametrize(
    ("line", "pattern", "found"),
    [
        ("# see targets.md section 5", OUTSIDE_DOCS, True),
        ("# the budget of issue 3", OUTSIDE_DOCS, True),
        ("# UCM #989 leaked events", OUTSIDE_DOCS, False),
        ("# ~150 ns on the development VM", MACHINE_TIMING, True),
        ("# a 2 µs budget per layer", MACHINE_TIMING, False),
        ("# parses every range (about 2 ms of apply time)", MACHINE_TIMING, True),
        ("reference figures: ≈0.7 GiB/s put on loopback", MACHINE_TIMING, True),
        ("# XXH3 runs at 19.7 GB/s here", MACHINE_TIMING, True),
        ("# 33 us per MiB while hashing", MACHINE_TIMING, True),
        ("# the whole 30 ms start-up budget", MACHINE_TIMING, False),
        ("# keys = {f'k{i}' for i in range(64)}", MACHINE_TIMING, False),
    ],
)
def test_the_patterns_tell_apart(line, pattern, found):
    """The checks themselves: what they flag and what they leave alone."""
    assert bool(pattern.search(line)) is found
