"""One PNG per benchmark into docs/img/, from the results :mod:`bench_run` kept.

matplotlib (the ``bench`` extra) with the Agg backend; a plot whose benchmark has no
result this time is deleted, so the document never shows a plot of an older run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc

IMG = bc.REPO / "docs" / "img"


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            "bench_all: matplotlib is needed for the plots: .venv/bin/pip install -e '.[bench]'"
        ) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9})
    return plt


def plot_core(d: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 2.2))
    names = ["`import ucm_patch` added to start", f"apply {d['apply']['applied']} records"]
    vals = [d["start"]["added_ms"], d["apply"]["apply_ms"]]
    budgets = [30.0, 5.0]
    ax.barh(names, vals, color=["#4c72b0", "#55a868"])
    for i, (v, b) in enumerate(zip(vals, budgets, strict=True)):
        ax.plot([b, b], [i - 0.4, i + 0.4], "r--")
        ax.text(v, i, f" {v:.2f} ms (budget {b:.0f})", va="center")
    ax.set_xlabel("ms")
    ax.set_xlim(0, max(vals + budgets) * 1.6)
    ax.set_title("core: start-up and apply cost (red: budget)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_hooks(rows: list[dict[str, Any]] | None, dump: dict[str, Any] | None, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    if rows:
        labels = [f"{r['case']}\n{r['path']} / {r['applied_as']}" for r in rows]
        vals = [r["added_ns"] for r in rows]
        colors = ["#4c72b0" if r["case"] == "no connector" else "#dd8452" for r in rows]
        y = range(len(rows))
        ax.barh(list(y), vals, color=colors)
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.axvline(150, color="g", ls=":", label="peers G1: 150 ns")
        ax.axvline(1000, color="#4c72b0", ls="--", label="budget: 1 us (idle)")
        ax.axvline(2000, color="#dd8452", ls="--", label="budget: 2 us (nothing to dump)")
        ax.legend(fontsize=7)
        ax.invert_yaxis()
    ax.set_xlabel("ns added per layer call over the bare call")
    ax.set_title("GDN wrappers: idle / connector with nothing to dump")
    ax = axes[1]
    if dump:
        paths = dump["results"]["paths"]
        names = [n for n in paths if n != "bare function"]
        vals = [paths[n]["added_ns"] for n in names]
        stalls = [paths[n]["added_ns_incl_stalls"] for n in names]
        y = list(range(len(names)))
        ax.barh([i - 0.2 for i in y], vals, height=0.4, label="median call", color="#55a868")
        ax.barh([i + 0.2 for i in y], stalls, height=0.4, label="incl. GIL stalls", color="#c44e52")
        ax.set_yticks(y, [n.replace(", ", "\n") for n in names], fontsize=7)
        ax.axvline(1500, color="r", ls="--", label="peers G2: 1.5 us")
        ax.legend(fontsize=7)
        ax.invert_yaxis()
    ax.set_xlabel("ns added per layer call")
    ax.set_title("save path into UCMPatchConnector + DumpScheduler")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_step(d: dict[str, Any], path: Path) -> None:
    plt = _plt()
    res = d["results"]
    fig, axes = plt.subplots(1, len(res), figsize=(5 * len(res), 3.4), squeeze=False)
    for ax, r in zip(axes[0], res.values(), strict=True):
        ax.boxplot([r["off_times_ms"], r["on_times_ms"]], showfliers=True)
        ax.set_xticks([1, 2], ["UCM_PATCH=0", "ucm_patch on"])
        ax.set_ylabel("ms per llm.generate")
        lo, hi = r["ratio_ci95"]
        ax.set_title(
            f"{r['model']}\nratio {r['ratio']:.4f} (95% CI {lo:.3f}-{hi:.3f}), target <= 1.01",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_overlap(d: dict[str, Any], path: Path) -> None:
    plt = _plt()
    res = d["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    a = res.get("scheduler")
    ax = axes[0]
    if a:
        loads = [r["load"] for r in a["rows"]]
        for mode, style in (("ucm async", "o-"), ("ucm blocking", "s--"), ("sync layerwise", "^:")):
            ax.plot(loads, [r["modes"][mode]["ratio"] for r in a["rows"]], style, label=mode)
        ax.axhline(1.05, color="r", ls="--", label="target 1.05")
        ax.set_xlabel("dump work / compute per step")
        ax.set_ylabel("step time with dumps / without")
        ax.legend(fontsize=7)
        ax.set_title(f"A. scheduler level, {a['layers']} layers, controlled store", fontsize=9)
    ax = axes[1]
    b = res.get("vllm")
    if b and b["rows"]:
        names = [f"{r['connector']}\n{r['mode']}" for r in b["rows"]]
        ratios = [r["ratio"] for r in b["rows"]]
        hidden = [r["hidden_share"] for r in b["rows"]]
        colors = ["#55a868" if "UCM" in r["connector"] else "#c44e52" for r in b["rows"]]
        ax.bar(range(len(names)), ratios, color=colors)
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.axhline(1.05, color="r", ls="--")
        for i, (rt, h) in enumerate(zip(ratios, hidden, strict=True)):
            label = f"{rt:.3f}" + (f"\nhidden {h * 100:.0f}%" if h is not None else "")
            ax.text(i, rt, label, ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("prefill time with dumps / without")
        ax.set_ylim(0, max(ratios) * 1.3)
        ax.set_title("B. real vLLM CPU, same latency + bandwidth store", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_ttft(d: dict[str, Any], path: Path) -> None:
    plt = _plt()
    res = {k: v for k, v in d["results"].items() if "error" not in v}
    keys = ("recompute", "hit", "replay", "vllm_prefix_cache")
    labels = ("miss (recompute)", "80 % prefix hit", "whole-prompt replay", "vLLM prefix cache")
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(keys)
    for j, (k, lab) in enumerate(zip(keys, labels, strict=True)):
        xs = [i + (j - 1.5) * width for i in range(len(res))]
        ax.bar(xs, [r["ms"][k] for r in res.values()], width=width, label=lab)
    names = [d["labels"].get(k, k) for k in res]
    for i, r in enumerate(res.values()):
        top = max(r["ms"][k] for k in keys)
        ax.text(i, top * 1.02, f"{r['speedup_hit']:.2f}x", ha="center", fontsize=8)
    ax.set_ylim(0, max(max(r["ms"][k] for k in keys) for r in res.values()) * 1.15)
    ax.set_xticks(range(len(res)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    ax.set_ylabel("TTFT, ms (median)")
    p = d["params"]
    ax.set_title(
        f"TTFT, {p['prompt_len']}-token prompts, {p['shared_tokens']} shared "
        f"({p['model_params'] / 1e6:.0f} M-param Qwen3, CPU); label: miss / hit speed-up",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_stores(d: dict[str, Any], path: Path) -> None:
    import statistics

    plt = _plt()
    sizes = d.get("sizes", {})
    n = max(1, len(sizes))
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 3.8), squeeze=False)
    for ax, (label, sd) in zip(axes[0], sizes.items(), strict=False):
        res = sd["results"]
        mem = statistics.median(res["memcpy"]["memcpy into preallocated"])
        names, puts, gets = [], [], []
        for name, ops in res.items():
            if name == "memcpy" or "put" not in ops:
                continue
            names.append(name)
            puts.append(100 * statistics.median(ops["put"]) / mem)
            gets.append(100 * statistics.median(ops["get_into"]) / mem if "get_into" in ops else 0)
        y = list(range(len(names)))
        ax.barh([i - 0.2 for i in y], puts, height=0.4, label="put")
        ax.barh([i + 0.2 for i in y], gets, height=0.4, label="get into buffers")
        ax.set_yticks(y, names, fontsize=7)
        ax.axvline(60, color="r", ls="--", label="memory tier target")
        ax.axvline(50, color="m", ls=":", label="disk tier target")
        ax.set_xlabel("% of memcpy in the same run (median)")
        ax.invert_yaxis()
        ax.set_title(f"{label} values", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_all(data: dict[str, Any]) -> list[str]:
    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    jobs: list[tuple[str, Callable[[], None]]] = []
    if data.get("core"):
        jobs.append(("core", lambda: plot_core(data["core"], IMG / "core.png")))
    if data.get("hooks") or data.get("dump_hook"):
        jobs.append(
            (
                "hooks",
                lambda: plot_hooks(data.get("hooks"), data.get("dump_hook"), IMG / "hooks.png"),
            )
        )
    if data.get("step"):
        jobs.append(("step", lambda: plot_step(data["step"], IMG / "step.png")))
    if data.get("overlap"):
        jobs.append(("overlap", lambda: plot_overlap(data["overlap"], IMG / "overlap.png")))
    if data.get("ttft"):
        jobs.append(("ttft", lambda: plot_ttft(data["ttft"], IMG / "ttft.png")))
    if data.get("stores"):
        jobs.append(("stores", lambda: plot_stores(data["stores"], IMG / "stores.png")))
    for name, job in jobs:
        job()
        made.append(name)
    for stale in {"core", "hooks", "step", "overlap", "ttft", "stores"} - set(made):
        (IMG / f"{stale}.png").unlink(missing_ok=True)  # never show a plot of an older run
    return made
