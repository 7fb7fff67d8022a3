"""Run every benchmark, plot each one, and rewrite docs/BENCHMARKS.md (``make bench``).

Three stages, each its own module: :mod:`bench_run` (one subprocess per benchmark, results
under ``bench-results/``), :mod:`bench_plot` (docs/img/*.png) and :mod:`bench_render`
(docs/BENCHMARKS.md). None of this is a test: the numbers depend on the machine and on
its load, which the document records.

usage: bench_all.py [--only stores,load_proxy,core,hooks,dump_hook,step,overlap,ttft] [--quick]
                    [--no-run] (only re-render plots and the document from bench-results/)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_plot
import bench_render
import bench_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benches = bench_run.BENCHES
    ap.add_argument("--only", default=",".join(benches), help="comma list of benchmarks to run")
    ap.add_argument("--quick", action="store_true", help="smoke variants of every benchmark")
    ap.add_argument("--no-run", action="store_true", help="only re-render from bench-results/")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(benches)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; accepted: {', '.join(benches)}")
    if not args.no_run:
        bench_run.run(names, args.quick)
    found = bench_run.results()
    if found is None:
        ap.error("--no-run: no bench-results/bench_all.json yet; run the benchmarks first")
    data, runs, meta = found
    made = bench_plot.plot_all(data)
    bench_render.DOC.write_text(bench_render.render_doc(data, runs, meta))
    print(f"plots: {', '.join(f'docs/img/{m}.png' for m in made)}; document: {bench_render.DOC}")
    failed = [n for n, r in runs.items() if not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
