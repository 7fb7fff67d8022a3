"""Human-readable views of the registry report (status table, JSON).

The default table fits a 100-column terminal: record id, state, the target's qualified
name (module dropped), ceiling and the reason cut to what is left of the line; ``wide``
shows every column in full (module path, requires, installed versions, the whole reason).
On a terminal the state is coloured (``NO_COLOR`` switches that off, as everywhere).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

WIDE_COLUMNS = ("id", "state", "target", "requires", "ceiling", "installed", "reason")
WIDTH = 100
# States whose reason is worth a line of its own in the compact table (the others say
# what the state already says: another era, not imported yet, switched off).
EXPLAINED = frozenset(
    {"applied", "failed", "native", "untested-version", "target-missing", "revert-refused"}
)

# ANSI colours per state; states not listed stay plain.
_GREEN, _RED, _YELLOW, _DIM, _RESET = "\033[32m", "\033[31m", "\033[33m", "\033[2m", "\033[0m"
STATE_COLOURS = {
    "applied": _GREEN,
    "failed": _RED,
    "revert-refused": _RED,
    "untested-version": _YELLOW,
    "native": _YELLOW,
    "target-missing": _YELLOW,
    "skipped-version": _DIM,
    "disabled": _DIM,
    "waiting-for-import": _DIM,
    "inactive": _DIM,
}


def _requires(row: dict[str, Any]) -> str:
    return " ".join(f"{d}{s}" for d, s in row["requires"].items())


def _ceiling(row: dict[str, Any]) -> str:
    return " ".join(f"{d}{c}" for d, c in row.get("ceiling", {}).items()) or "-"


def _installed(row: dict[str, Any]) -> str:
    return " ".join(f"{d} {v}" for d, v in row["installed"].items()) or "-"


def _reason(row: dict[str, Any]) -> str:
    return row["reason"] or (f"toggle: {row['toggle']}" if row["toggle"] else "")


def _short_target(row: dict[str, Any], width: int) -> str:
    """``Class.method`` (or ``function``) without its module, with the op's short name,
    cut from the left to ``width``."""
    text = row["target"].partition(":")[2] or row["target"]
    if row.get("op"):
        text += f" [{row['op'].partition('::')[2]}]"
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _short_ceiling(row: dict[str, Any]) -> str:
    return (
        " ".join(f"{d.removeprefix('vllm-')}{c}" for d, c in row.get("ceiling", {}).items()) or "-"
    )


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _paint(text: str, state: str, color: bool) -> str:
    return f"{STATE_COLOURS[state]}{text}{_RESET}" if color and state in STATE_COLOURS else text


def format_table(
    rows: Sequence[dict[str, Any]], wide: bool = False, width: int = WIDTH, color: bool = False
) -> str:
    """The status table. Default: grouped by patch, one line per era (era, state,
    ceiling, target cut to fit) and the reason on a line below where it tells something
    (:data:`EXPLAINED`), every line at most ``width`` characters. ``wide``: one line per
    record with every column in full. ``color``: ANSI-coloured states (a terminal)."""
    if wide:
        return _wide(rows, color)
    eras = [r["id"].partition("@")[2] for r in rows]
    era_w = max([len("PATCH / ERA") - 2, *(len(e) for e in eras)])
    state_w = max([len("STATE"), *(len(r["state"]) for r in rows)])
    ceil_w = max([len("CEILING"), *(len(_short_ceiling(r)) for r in rows)])
    target_w = max(width - (2 + era_w + 2 + state_w + 2 + ceil_w + 2), 12)
    head = f"{'PATCH / ERA'.ljust(2 + era_w)}  {'STATE'.ljust(state_w)}  "
    lines = [f"{head}{'CEILING'.ljust(ceil_w)}  TARGET"]
    patch = None
    for row, era in zip(rows, eras, strict=True):
        name = row["id"].partition("@")[0]
        if name != patch:
            patch = name
            lines.append(name)
        state = row["state"]
        line = (
            f"  {era.ljust(era_w)}  {_paint(state.ljust(state_w), state, color)}  "
            f"{_short_ceiling(row).ljust(ceil_w)}  {_short_target(row, target_w)}"
        )
        lines.append(line.rstrip())
        reason = row["reason"]  # not the toggle: the default decision says nothing
        if reason and state in EXPLAINED:
            lines.append(_cut("      " + reason, width))
    return "\n".join(lines)


def _wide(rows: Sequence[dict[str, Any]], color: bool) -> str:
    cells = [
        (
            r["id"],
            r["state"],
            r["target"] + (f" [op {r['op']}]" if r.get("op") else ""),
            _requires(r),
            _ceiling(r),
            _installed(r),
            _reason(r),
        )
        for r in rows
    ]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(WIDE_COLUMNS)]
    widths[-1] = len(WIDE_COLUMNS[-1])  # the reason column is not padded
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(WIDE_COLUMNS, widths, strict=True))]
    for row in cells:
        values = [v.ljust(w) for v, w in zip(row, widths, strict=True)]
        values[1] = _paint(values[1], row[1], color)
        lines.append("  ".join(values).rstrip())
    return "\n".join(lines)


def format_json(rows: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(rows), indent=2, sort_keys=True)
