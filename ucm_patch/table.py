"""Human-readable views of the registry report (status table, JSON)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

COLUMNS = ("id", "state", "target", "requires", "ceiling", "installed", "reason")


def _requires(row: dict[str, Any]) -> str:
    return " ".join(f"{d}{s}" for d, s in row["requires"].items())


def _ceiling(row: dict[str, Any]) -> str:
    return " ".join(f"{d}{c}" for d, c in row.get("ceiling", {}).items()) or "-"


def _installed(row: dict[str, Any]) -> str:
    return " ".join(f"{d} {v}" for d, v in row["installed"].items()) or "-"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one line per record, for terminals and logs."""
    cells = [
        (
            r["id"],
            r["state"],
            r["target"] + (f" [op {r['op']}]" if r.get("op") else ""),
            _requires(r),
            _ceiling(r),
            _installed(r),
            r["reason"] or (f"toggle: {r['toggle']}" if r["toggle"] else ""),
        )
        for r in rows
    ]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    widths[-1] = len(COLUMNS[-1])  # the reason column is not padded
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def format_json(rows: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(rows), indent=2, sort_keys=True)
