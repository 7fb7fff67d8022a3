"""``ucm-patch`` command line: status of every patch, the generated patch docs, and the
local store's memory tiers on this host (``ucm-patch tiers``).

``ucm-patch status`` works with no vLLM installed: it shows each record's gate and toggle
decision. With ``--import-targets`` it imports the target modules first, so the states
are the ones a vLLM process would end up with (applied / failed / target-missing).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ucm_patch.errors import ConfigError


def _status(args: argparse.Namespace) -> int:
    # Activation reads the environment; importing ucm_patch may already have activated.
    import ucm_patch
    from ucm_patch.status_table import format_json, format_table

    if not ucm_patch.enabled_by_env():
        print("ucm_patch is switched off (UCM_PATCH=0)", file=sys.stderr)
    else:
        ucm_patch.activate()
    if args.import_targets:
        for module in sorted(
            {
                r["target"].partition(":")[0]
                for r in ucm_patch.report()
                if r["state"] == "waiting-for-import"
            }
        ):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                print(f"ucm-patch: cannot import {module}: {exc}", file=sys.stderr)
    rows = ucm_patch.report()
    failed = any(r["state"] == "failed" for r in rows)
    if args.state:
        wanted = _states(args.state)
        rows = [r for r in rows if r["state"] in wanted]
    if args.json:
        print(format_json(rows))
    else:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(format_table(rows, wide=args.wide, color=color))
    return 1 if failed else 0


def _states(values: Sequence[str]) -> set[str]:
    """``--state`` values (repeated or comma-separated), each a known record state."""
    from ucm_patch.registry import State

    known = {str(v) for k, v in vars(State).items() if not k.startswith("_")}
    wanted = {s.strip() for v in values for s in v.split(",") if s.strip()}
    bad = sorted(wanted - known)
    if bad:
        raise ConfigError(f"--state {', '.join(bad)}: not a record state; one of {sorted(known)}")
    return wanted


def _docs(args: argparse.Namespace) -> int:
    from ucm_patch.docs import render_patches_md

    path = args.output
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    new = render_patches_md(old)
    if args.check:
        if old != new:
            print(f"{path} is stale: run `ucm-patch docs` (make docs)", file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)
    print(f"wrote {path}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # not reached


def _tiers(args: argparse.Namespace) -> int:
    """List the memory tiers of this host (a tmpfs: RAM) and remove the orphaned ones."""
    import json
    import time

    # the store's own code (stdlib only at import): what a store does when it opens
    from ucm_patch.hooks.stores.memory_tiers import survey, tier_base

    base = args.base or tier_base()
    found = survey(base, remove_orphans=args.remove_orphans, remove_unowned=args.remove_unowned)
    if args.json:
        print(json.dumps({"base": base, "tiers": [t.as_dict() for t in found]}, indent=2))
        return 0
    if not found:
        print(f"no memory tiers in {base}")
        return 0
    header = ("PATH", "STATE", "TMPFS", "LAST USE", "PROCESSES", "LOCAL_PATH")
    rows = [header]
    for t in found:
        when = "-" if t.last_use is None else time.strftime("%F %T", time.localtime(t.last_use))
        state = f"{t.state} (removed)" if t.removed else t.state
        pids = ",".join(map(str, t.pids)) or "-"
        rows.append((t.path, state, _size(t.size_bytes), when, pids, t.local_path or "?"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    for t in found:
        if t.reason:
            print(f"{t.path}: {t.state}{' (removed)' if t.removed else ''}: {t.reason}")
    held = sum(t.size_bytes for t in found if not t.removed)
    freed = sum(t.size_bytes for t in found if t.removed)
    print(f"{len(found)} tier(s) in {base}: {_size(held)} held in tmpfs", end="")
    print(f", {_size(freed)} freed" if freed else "")
    orphans = [t for t in found if t.state == "orphan" and not t.removed]
    if orphans:
        print(f"{len(orphans)} orphan(s): `ucm-patch tiers --remove-orphans` removes them")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm-patch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="show every patch record and its state")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument(
        "--wide", action="store_true", help="full targets, requires and installed versions"
    )
    st.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="STATE[,STATE]",
        help="only records in these states (applied, failed, native, untested-version, ...)",
    )
    st.add_argument(
        "--import-targets",
        action="store_true",
        help="import the target modules first (needs the patched libraries)",
    )
    st.set_defaults(func=_status)
    docs = sub.add_parser("docs", help="regenerate docs/PATCHES.md from the records")
    docs.add_argument("--output", default="docs/PATCHES.md")
    docs.add_argument("--check", action="store_true", help="fail if the file is stale")
    docs.set_defaults(func=_docs)
    tiers = sub.add_parser(
        "tiers",
        help="list the memory tiers of this host (tmpfs) and remove orphaned ones",
        description="List the local store's memory tiers on this host (their path, state, "
        "bytes held in the tmpfs, last use, the processes using them, their local_path). "
        "A tier is an orphan when its local_path is gone or is another directory now: "
        "nothing can read it again. The next store that opens removes orphans too.",
    )
    tiers.add_argument("--json", action="store_true", help="machine-readable output")
    tiers.add_argument(
        "--remove-orphans", action="store_true", help="remove the orphans no process uses"
    )
    tiers.add_argument(
        "--remove-unowned",
        action="store_true",
        help="also remove tiers without an owner record (made by an earlier ucm_patch) "
        "that no process maps",
    )
    tiers.add_argument(
        "--base",
        help="tier directory (default: $XDG_RUNTIME_DIR/ucm_patch, else /dev/shm/ucm_patch-<uid>)",
    )
    tiers.set_defaults(func=_tiers)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ucm-patch: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
