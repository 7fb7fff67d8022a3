"""docs/BENCHMARKS.md's rows of the load proxy (``bench_load_proxy.py``): a GPU hit's host
side measured on CPU, against the targets a GPU hit needs of it (docs/GPU.md)."""

from __future__ import annotations

import statistics
from typing import Any

import bench_common as bc

#: Beside a Python thread, loads keep at least this share of their speed alone.
BESIDE_SHARE = 0.50
#: Host CPU-seconds the load threads may spend per GB loaded.
CPU_S_PER_GB = 0.3
#: Wall time of a load alone, at most this many times a memcpy and an XXH3 side by side.
WALL_VS_FLOOR = 1.25
#: The first load in a new process, at most this many times a steady one.
FIRST_VS_STEADY = 1.1


def _times(ratio: float, limit: float) -> str:
    """``ratio`` as ``1.23x``; with a third decimal when two would read as the limit it
    misses (1.254 against 1.25: "1.25x, missed" said nothing)."""
    if ratio > limit and round(ratio, 2) <= limit:
        return f"{ratio:.3f}x"
    return f"{ratio:.2f}x"


def _of(d: dict[str, Any]) -> str:
    """How many fresh processes a first pass is the median of, when more than one."""
    n = d.get("processes", 1)
    return f" (median of {n} processes' own ratios)" if n > 1 else ""


def load_proxy_targets(d: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    """The four CPU-proxy targets of loads and of dumps, GIL waits per value as
    information."""
    if not d or "summary" not in d:
        return []
    s = d["summary"]
    what = f"{d['values']} values of {d['value_bytes'] >> 20} MiB, {d['threads']} load threads"
    rows = [
        (f"load proxy, beside a Python thread vs alone ({what})", f">= {BESIDE_SHARE:.0%}",
         f"{s['beside_share']:.1%} ({s['beside_python_gbps']:.2f} of {s['alone_gbps']:.2f} GB/s)",
         bc.verdict(s["beside_share"] >= BESIDE_SHARE)),
        ("load proxy, load threads' CPU-seconds per GB", f"<= {CPU_S_PER_GB}",
         f"{s['cpu_s_per_gb']:.2f}", bc.verdict(s["cpu_s_per_gb"] <= CPU_S_PER_GB)),
        ("load proxy, wall alone vs memcpy and XXH3 side by side", f"<= {WALL_VS_FLOOR}x",
         _times(s["wall_vs_floor"], WALL_VS_FLOOR),
         bc.verdict(s["wall_vs_floor"] <= WALL_VS_FLOOR)),
        (f"load proxy, first load in a new process vs steady{_of(d)}", f"<= {FIRST_VS_STEADY}x",
         _times(s["first_vs_steady"], FIRST_VS_STEADY),
         bc.verdict(s["first_vs_steady"] <= FIRST_VS_STEADY)),
        ("load proxy, GIL waits per value beside a Python thread", "(information)",
         f"{s['gil_waits_per_value']:.2f}", "(information)"),
    ]  # fmt: skip
    dumps = d.get("dumps")
    if dumps and "summary" in dumps:  # the same four for dumps: a row's puts, fresh keys
        u = dumps["summary"]
        rows += [
            (f"dump proxy, beside a Python thread vs alone ({dumps['threads']} dump threads)",
             f">= {BESIDE_SHARE:.0%}", f"{u['beside_share']:.1%} ({u['beside_python_gbps']:.2f} "
             f"of {u['alone_gbps']:.2f} GB/s)", bc.verdict(u["beside_share"] >= BESIDE_SHARE)),
            ("dump proxy, dump threads' CPU-seconds per GB", f"<= {CPU_S_PER_GB}",
             f"{u['cpu_s_per_gb']:.2f}", bc.verdict(u["cpu_s_per_gb"] <= CPU_S_PER_GB)),
            ("dump proxy, wall alone vs memcpy and XXH3 side by side", f"<= {WALL_VS_FLOOR}x",
             _times(u["wall_vs_floor"], WALL_VS_FLOOR),
             bc.verdict(u["wall_vs_floor"] <= WALL_VS_FLOOR)),
            (f"dump proxy, first dump in a new process vs steady{_of(dumps)}",
             f"<= {FIRST_VS_STEADY}x",
             _times(u["first_vs_steady"], FIRST_VS_STEADY),
             bc.verdict(u["first_vs_steady"] <= FIRST_VS_STEADY)),
            ("dump proxy, GIL waits per value beside a Python thread", "(information)",
             f"{u['gil_waits_per_value']:.2f}", "(information)"),
        ]  # fmt: skip
        firsts = dumps.get("firsts") or []
        if len(firsts) > 1:  # the spread behind the median first pass
            steady = statistics.median(p["wall_s"] for p in dumps["alone"]) * 1e3
            each = ", ".join(f"{f['wall_s'] * 1e3:.0f}" for f in firsts)
            rows.append(
                ("dump proxy, each process's first dump and the steady median, ms",
                 "(information)", f"{each}; {steady:.0f}", "(information)")
            )  # fmt: skip
        if "beside_hog_share" in u:  # the ceiling the host's cores set on the first row
            rows.append(
                ("dump proxy, beside a process taking a core (no GIL of ours) vs alone; the "
                 "Python thread's figure against it", "(information)",
                 f"{u['beside_hog_share']:.1%}; {u['beside_python_vs_hog']:.1%}",
                 "(information)")
            )  # fmt: skip
    for who, run in (("load", d), ("dump", dumps or {})):
        ratios = run.get("first_ratios") or []
        if len(ratios) > 1:  # what the first-vs-steady median is taken over
            rows.append(
                (f"{who} proxy, each process's first pass vs its own steady median",
                 "(information)", ", ".join(f"{r:.2f}x" for r in sorted(ratios)),
                 "(information)")
            )  # fmt: skip
        read = run.get("pages_read_s")
        if isinstance(read, list) and read:  # what this host had dropped (docs/CONNECTOR.md)
            rows.append(
                (f"{who} proxy, seconds to read every page of the memory tier before the "
                 "first pass, per process (this host drops idle memory's mapping)",
                 "(information)", ", ".join(f"{t:.2f}" for t in read), "(information)")
            )  # fmt: skip
    old = d.get("per_value", {}).get("summary")
    if old:  # the same loads without the row helper (a host with no C compiler)
        rows.append(
            ("load proxy, value by value (no C compiler): beside a Python thread vs alone, "
             "GIL waits per value", "(information)",
             f"{old['beside_share']:.1%} ({old['beside_python_gbps']:.2f} of "
             f"{old['alone_gbps']:.2f} GB/s), {old['gil_waits_per_value']:.2f}",
             "(information)")
        )  # fmt: skip
    return rows
