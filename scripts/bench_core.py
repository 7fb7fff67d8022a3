"""Benchmark the core's budgets (issue 2): start-up cost and apply cost.

1. ``import ucm_patch`` added to interpreter start: wall time of ``python -c 'import
   ucm_patch'`` minus ``python -c 'pass'``, each the minimum over N fresh interpreters
   (budget: under 30 ms; it must import neither vllm nor torch).
2. Applying every record after ``import vllm``: the targets are imported first (with
   ``UCM_PATCH=0`` so nothing is applied yet), then ``ucm_patch.activate()`` is timed: it
   applies every in-range, enabled record at once (budget: under 5 ms).

Prints a table and writes bench-results/core.json. Not a test: numbers vary by machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench-results"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    env.update(extra)
    return env


def start_cost(runs: int) -> dict[str, float]:
    def best(code: str) -> float:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd="/")
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    base = best("pass")
    with_import = best("import ucm_patch")
    heavy = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ucm_patch; print(sorted(m for m in "
            "('vllm', 'torch', 'wrapt') if m in sys.modules))",
        ],
        check=True,
        env=_env(),
        cwd="/",
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "python_start_ms": base,
        "with_import_ms": with_import,
        "added_ms": with_import - base,
        "heavy_modules_imported": heavy,
    }


APPLY = r"""
import importlib, json, time
import ucm_patch
reg = ucm_patch.registry()
rows = reg.report()   # gates every record (reads metadata) before timing
targets = sorted({r["target"].partition(":")[0] for r in rows if r["state"] != "skipped-version"})
unimportable = []
for mod in targets:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # GPU-only modules fail on CPU in many ways: note and skip
        unimportable.append(f"{mod}: {type(exc).__name__}")
t0 = time.perf_counter()
ucm_patch.activate(env={})
elapsed = (time.perf_counter() - t0) * 1e3
rows = ucm_patch.report()
print(json.dumps({"apply_ms": elapsed, "records": len(rows),
                  "applied": sum(r["state"] == "applied" for r in rows),
                  "targets_imported": len(targets) - len(unimportable),
                  "unimportable": unimportable}))
"""


def apply_cost(runs: int) -> dict[str, float]:
    results = []
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-c", APPLY],
            check=True,
            capture_output=True,
            text=True,
            env=_env(UCM_PATCH="0"),
            cwd="/",
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    best = min(results, key=lambda r: r["apply_ms"])
    return best


def main() -> int:
    runs = int(os.environ.get("BENCH_RUNS", "15"))
    start = start_cost(runs)
    apply = apply_cost(max(3, runs // 5))
    OUT.mkdir(exist_ok=True)
    result = {"start": start, "apply": apply, "python": sys.version.split()[0]}
    (OUT / "core.json").write_text(json.dumps(result, indent=2))
    print("| measure | value | budget |")
    print("|---|---|---|")
    print(f"| `import ucm_patch` added to start | {start['added_ms']:.1f} ms | < 30 ms |")
    print(f"| heavy modules imported by it | {start['heavy_modules_imported']} | none |")
    print(
        f"| apply {apply['applied']} records after import of their targets "
        f"| {apply['apply_ms']:.2f} ms | < 5 ms |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
