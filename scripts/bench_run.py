"""Run the benchmark scripts, one subprocess each, and keep their results (``make bench``).

Each benchmark runs in a fresh interpreter (patching and vLLM state are process-global)
and writes its JSON under ``bench-results/``; :func:`run` records how each run went
(exit status, wall time, load before and after, output tails) and the machine in
``bench-results/bench_all.json``, which :mod:`bench_plot` and :mod:`bench_render` read. A
benchmark that fails is recorded as failed; the others still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

SCRIPTS = bc.REPO / "scripts"
OUT = bc.RESULTS
META = OUT / "bench_all.json"

# name -> (command after the interpreter, quick variant, timeout s, JSON the run leaves), in
# the order they run: the short ones whose figures the host's load moves most (the stores'
# slowest put call, the load proxy's GIL figures, the hooks' nanoseconds) first, on the quiet
# machine a run starts on; the vLLM runs, which report confidence intervals, after them.
BENCHES: dict[str, tuple[list[str], list[str], int, str]] = {
    "stores": (
        ["bench_stores.py", "--out", str(OUT / "stores")],
        [
            "bench_stores.py",
            "--total",
            "32MiB",
            "--repeat",
            "2",
            "--full-seconds",
            "1",
            "--out",
            str(OUT / "stores"),
        ],
        900,
        "",
    ),
    # a GPU hit's host side on CPU: 900 values of 1 MiB loaded by a fresh process, alone and
    # beside a Python thread (about a minute with the full count)
    "load_proxy": (
        ["bench_load_proxy.py"],
        ["bench_load_proxy.py", "--values", "200", "--repeat", "2", "--processes", "1"],
        900,
        "load_proxy.json",
    ),
    "core": (["bench_core.py"], ["bench_core.py"], 600, "core.json"),
    "hooks": (
        ["bench_hooks.py", "--json", str(OUT / "hooks.json")],
        ["bench_hooks.py", "--number", "20000", "--repeat", "3", "--json", str(OUT / "hooks.json")],
        600,
        "hooks.json",
    ),
    "dump_hook": (["bench_dump_hook.py"], ["bench_dump_hook.py", "--steps", "50"], 600, ""),
    # 16 vLLM starts (4 off/on pairs, two models) and 40 in-process toggle pairs: past
    # 20 min on a 2-core machine, where 1200 s cut it off before it wrote anything
    "step": (["bench_step.py"], ["bench_step.py", "--quick"], 3000, ""),
    # real vLLM runs too (bench B, TTFT): both passed their old limits (900 s, 1500 s) on
    # the machine of 2026-11-26, where a vLLM start took about a minute
    "overlap": (["bench_overlap.py"], ["bench_overlap.py", "--quick"], 1800, ""),
    # ours and no connector (4 repetitions each, up to 1500 s apiece there), then the peers
    "ttft": (["bench_ttft.py"], ["bench_ttft.py", "--quick"], 5400, ""),
}


def run_bench(name: str, quick: bool) -> dict[str, Any]:
    full, short, timeout, _ = BENCHES[name]
    cmd = [sys.executable, str(SCRIPTS / (short if quick else full)[0])]
    cmd += (short if quick else full)[1:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if quick and name == "core":
        env["BENCH_RUNS"] = "5"
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=bc.REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = -1, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout} s"
    wall = time.perf_counter() - started
    print(out.rstrip()[-4000:], flush=True)
    # bench_hooks exits 1 when a row is over its budget: a result, not a failure.
    ok = rc == 0 or (name == "hooks" and rc == 1 and (OUT / "hooks.json").exists())
    if not ok:
        print(f"!! {name} failed (rc={rc}); stderr tail:\n{err[-3000:]}", flush=True)
    return {
        "rc": rc,
        "ok": ok,
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "stdout": out[-8000:],
        "stderr": err[-4000:],
    }


def _text(x: bytes | str | None) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def load_json(name: str) -> Any:
    if name == "stores":
        folder = OUT / "stores"
        files = sorted(folder.glob("stores-*.json")) if folder.is_dir() else []
        return json.loads(files[-1].read_text()) if files else None
    path = OUT / (BENCHES[name][3] or f"{name}.json")
    return json.loads(path.read_text()) if path.exists() else None


def run(names: list[str], quick: bool) -> None:
    """Run ``names`` and write :data:`META`; a partial run keeps the earlier runs' records
    for the benchmarks it did not rerun."""
    OUT.mkdir(parents=True, exist_ok=True)
    load_start = list(os.getloadavg())
    started = time.perf_counter()
    machine = bc.machine(load_start[0])  # its "time" is when the run started
    print(f"load average at start: {load_start}", flush=True)
    runs = {name: run_bench(name, quick) for name in names}
    meta = {
        "machine": machine,
        "load_start": load_start,
        "load_end": list(os.getloadavg()),
        "total_s": time.perf_counter() - started,
        "quick": quick,
        "runs": {n: {k: v for k, v in r.items() if k != "stdout"} for n, r in runs.items()},
    }
    if META.exists() and set(names) != set(BENCHES):
        old = json.loads(META.read_text())
        meta["runs"] = {**old.get("runs", {}), **meta["runs"]}
    META.write_text(json.dumps(meta, indent=1))


def results() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """(data per benchmark, run records, meta) from the last :func:`run`, or None before
    any. A failed benchmark's JSON (if any) is from an earlier run: never mixed in."""
    if not META.exists():
        return None
    meta = json.loads(META.read_text())
    runs = {n: {"ok": True, "rc": 0, "stderr": "", **r} for n, r in meta["runs"].items()}
    data = {
        name: load_json(name) if runs.get(name, {}).get("ok", True) else None for name in BENCHES
    }
    return data, runs, meta
