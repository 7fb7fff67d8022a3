"""Benchmark the core's budgets: start-up cost and apply cost.

1. ``import ucm_patch`` added to interpreter start: wall time of a fresh interpreter that
   imports it minus one that does not, each the minimum over N runs (budget: under 30 ms;
   it must import neither vllm nor torch). Measured on the built wheel, unpacked and
   byte-compiled as ``pip install`` leaves it, in ``python -S`` (no site: nothing that a
   site hook or another package preloads is free for us, so every stdlib module ucm_patch
   needs is counted: an upper bound). Also shown: the same in this development venv
   (editable install, whose finder preloads pathlib & co. at start; with
   ``PYTHONDONTWRITEBYTECODE=1`` set, as here, its sources are compiled on every import).
2. Applying every record after ``import vllm``: the targets are imported first (with
   ``UCM_PATCH=0`` so nothing is applied yet), then ``ucm_patch.activate()`` is timed: it
   gates and applies every in-range, enabled record at once, and imports wrapt the first
   time (budget: under 5 ms). Shown again with wrapt imported beforehand, to separate
   wrapt's own import (vLLM does not import wrapt) from our work.

   The runs use a trampoline cache of their own (``XDG_CACHE_HOME`` in a temporary
   folder, :mod:`ucm_patch.trampoline_cache`): the first run finds it empty and compiles
   every trampoline, as the first start on a machine does (reported apart, as
   information); the timed runs load them, as every later start does. Each run collects
   garbage once before the clock starts, as ``timeit`` keeps the collector out of its
   timings: the objects ``import vllm`` left are not apply's, and a collection of them that
   happens to fall due in the timed window measured 1-2 ms. Apply's own allocations still
   run under the collector.

Prints a table and writes bench-results/core.json. Not a test: numbers vary by machine.
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench-results"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    env.update(extra)
    return env


def _best_ms(argv: list[str], runs: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, env=env, cwd="/")
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _installed_wheel(tmp: Path) -> Path:
    """Build the wheel, unpack it and byte-compile it: what ``pip install`` leaves."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(REPO), "-w", str(tmp)],
        check=True, env=_env(), capture_output=True,
    )  # fmt: skip
    wheel = next(tmp.glob("ucm_patch-*.whl"))
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    compileall.compile_dir(str(site), quiet=1)
    return site


def start_cost(runs: int) -> dict[str, Any]:
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        site = _installed_wheel(Path(tmp))
        prelude = f"import sys; sys.path.insert(0, {str(site)!r})"
        wheel_base = _best_ms([py, "-S", "-c", prelude], runs, _env())
        wheel_with = _best_ms([py, "-S", "-c", prelude + "; import ucm_patch"], runs, _env())
        heavy = subprocess.run(
            [py, "-S", "-c", prelude + "; import ucm_patch; print(sorted(m for m in "
             "('vllm', 'torch', 'wrapt') if m in sys.modules))"],
            check=True, env=_env(), cwd="/", capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    dev_base = _best_ms([py, "-c", "pass"], runs, _env())
    dev_with = _best_ms([py, "-c", "import ucm_patch"], runs, _env())
    return {
        "python_start_ms": wheel_base,
        "with_import_ms": wheel_with,
        "added_ms": wheel_with - wheel_base,
        "dev_venv_added_ms": dev_with - dev_base,
        "dev_venv_bytecode_cached": os.environ.get("PYTHONDONTWRITEBYTECODE", "") == "",
        "heavy_modules_imported": heavy,
    }


APPLY = r"""
import gc, importlib, json, sys, time
import ucm_patch
if "--wrapt-imported" in sys.argv:
    import wrapt  # noqa: F401  (what the first application would import)
reg = ucm_patch.registry()
rows = reg.report()   # the target list; activate() below gates again (timed)
targets = sorted({r["target"].partition(":")[0] for r in rows if r["state"] != "skipped-version"})
unimportable = []
for mod in targets:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # GPU-only modules fail on CPU in many ways: note and skip
        unimportable.append(f"{mod}: {type(exc).__name__}")
gc.collect()  # what import vllm left is not apply's garbage (see the module docstring)
t0 = time.perf_counter()
ucm_patch.activate(env={})
elapsed = (time.perf_counter() - t0) * 1e3
rows = ucm_patch.report()
print(json.dumps({"apply_ms": elapsed, "records": len(rows),
                  "applied": sum(r["state"] == "applied" for r in rows),
                  "targets_imported": len(targets) - len(unimportable),
                  "unimportable": unimportable}))
"""


def apply_cost(runs: int, *flags: str) -> dict[str, Any]:
    """The best of ``runs`` applications with the trampolines cached, and beside it
    (``first_start_ms``) the first, which compiled them into an empty cache."""
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(runs + 1):
            proc = subprocess.run(
                [sys.executable, "-c", APPLY, *flags],
                check=True,
                capture_output=True,
                text=True,
                env=_env(UCM_PATCH="0", XDG_CACHE_HOME=cache),
                cwd="/",
            )
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, cached = results[0], results[1:]
    best = min(cached, key=lambda r: r["apply_ms"])
    return {**best, "first_start_ms": first["apply_ms"]}


def main() -> int:
    runs = int(os.environ.get("BENCH_RUNS", "15"))
    start = start_cost(runs)
    apply = apply_cost(max(3, runs // 5))
    apply_warm = apply_cost(max(3, runs // 5), "--wrapt-imported")
    OUT.mkdir(exist_ok=True)
    result = {
        "start": start,
        "apply": apply,
        "apply_wrapt_imported": apply_warm,
        "python": sys.version.split()[0],
    }
    (OUT / "core.json").write_text(json.dumps(result, indent=2))
    print("| measure | value | budget |")
    print("|---|---|---|")
    print(
        f"| `import ucm_patch` added to start (installed wheel, `python -S`: upper bound) "
        f"| {start['added_ms']:.1f} ms | < 30 ms |"
    )
    print(
        f"| same, this development venv (editable install"
        f"{'' if start['dev_venv_bytecode_cached'] else ', sources compiled on each import'}) "
        f"| {start['dev_venv_added_ms']:.1f} ms | (information) |"
    )
    print(f"| heavy modules imported by it | {start['heavy_modules_imported']} | none |")
    print(
        f"| apply {apply['applied']} records after import of their targets "
        f"| {apply['apply_ms']:.2f} ms | < 5 ms |"
    )
    print(
        f"| same, first start on a machine (trampolines compiled, then cached) "
        f"| {apply['first_start_ms']:.2f} ms | (information) |"
    )
    print(
        f"| same, wrapt already imported (the line above imports it only if a record needs it) "
        f"| {apply_warm['apply_ms']:.2f} ms | (information) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
