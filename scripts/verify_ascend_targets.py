#!/usr/bin/env python3
"""Check every vLLM-Ascend patch record against the real vLLM-Ascend source of each version.

The source is *read* with ``ast``, never imported (torch-npu cannot run here); the engine
is :mod:`tools.verify.ascend`, this is its command line. Sources:

* PyPI releases (``--pypi 0.13.0`` or ``--pypi all``): downloaded with ``pip download
  --no-deps`` into ``.cache/vllm_ascend/dist`` (x86_64 cp311 wheels for 0.11.0 - 0.23.0; the
  0.23.0.post1 sdist needs ``SOC_VERSION=ascend910b1`` and ``--no-build-isolation`` with
  setuptools_scm, so it is fetched from a small venv under ``.cache/vllm_ascend/dlvenv``)
  and unpacked into ``.cache/vllm_ascend/src/<version>``. ``make test`` does this
  (tests/test_patches_ascend_sources.py): these are the cells marked "CI".
* A main-branch snapshot (``--git REPO --main COMMIT``): labelled ``main@<commit[:12]>`` and
  checked against the newest era of each patch, the records ``UCM_PATCH_ALLOW_UNTESTED``
  lets apply to an unreleased version. Verified outside CI; kept in the data file.
* A source checkout of an rc tag (``--source DIR --label v0.19.1rc1``; DIR holds
  ``vllm_ascend/``), or ``--git REPO --tag v0.19.1rc1`` to export it from a local clone
  (``git archive``). Verified outside CI; the results are kept in the data file.

For each version every record whose ``requires`` range contains it (the version gated the
way ``ucm_patch.versions`` gates: rc / post releases as their base release) must satisfy the
checks in its ``expect`` (``ucm_patch.source_checks``). On top, completeness
checks scan the whole tree: every by-name binding of the wait/save hooks has a record, every
GDN core that can run (and every copy vLLM-Ascend makes of one) is wrapped, every function
that marks a KV write is covered or listed in ``NOT_COVERED`` with the reason.

Outputs: ``scripts/data/ascend_signatures.json`` (``--write-data``: the facts and results
per version, which the tests compare the stand-ins against) and the matrix section of
docs/PATCHES.md between ``<!-- ascend-matrix:start -->`` and ``<!-- ascend-matrix:end -->``
(``--write-docs``). ``--check`` re-verifies the given sources and fails when their facts or
results differ from the data file (what CI runs after downloading the PyPI releases).

Examples::

    python scripts/verify_ascend_targets.py --pypi all --check
    python scripts/verify_ascend_targets.py --git ../vllm-ascend --tag v0.19.1rc1 --write-data
    python scripts/verify_ascend_targets.py --write-docs        # from the data file only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from tools.verify import ascend as verify
from tools.verify import ascend_report as report
from tools.verify import ascend_sources as sources


# -- command line ---------------------------------------------------------------------------
def _sources(args: argparse.Namespace) -> list[tuple[Path, str, str]]:
    out: list[tuple[Path, str, str]] = []
    pypi = list(sources.PYPI) if "all" in args.pypi else args.pypi
    for version in pypi:
        archive = sources.download(version)
        out.append((sources.unpack(archive, version), version, f"pypi-{sources.PYPI[version]}"))
    if args.source:
        if not args.label:
            raise sources.SourceError("--source needs --label (the version or tag it is)")
        out.append((Path(args.source), args.label, "tag"))
    for tag in args.tag:
        if not args.git:
            raise sources.SourceError("--tag needs --git (a local clone of vllm-ascend)")
        out.append((sources.export_tag(Path(args.git), tag), tag, "tag"))
    if args.main:
        if not args.git:
            raise sources.SourceError("--main needs --git (a local clone of vllm-ascend)")
        commit = args.main
        if len(commit) != 40:
            raise sources.SourceError(f"--main {commit!r}: give the full 40-digit commit")
        out.append((sources.export_tag(Path(args.git), commit), verify.main_label(commit), "main"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pypi", action="append", default=[], help="PyPI version, or 'all'")
    p.add_argument("--source", help="a source checkout holding vllm_ascend/")
    p.add_argument("--label", help="version / tag of --source (e.g. v0.19.1rc1)")
    p.add_argument("--git", help="a local git clone (or bare mirror) of vllm-ascend")
    p.add_argument("--tag", action="append", default=[], help="tag to export from --git")
    p.add_argument("--main", help="a main-branch commit of --git to verify (40 digits)")
    p.add_argument("--write-data", action="store_true", help=f"store results in {report.DATA.name}")
    p.add_argument("--write-docs", action="store_true", help="rewrite the docs matrix section")
    p.add_argument("--check", action="store_true", help="fail when results differ from the data")
    args = p.parse_args(argv)
    try:
        sources = _sources(args)
    except sources.SourceError as exc:
        print(f"verify_ascend_targets: {exc}", file=sys.stderr)
        return 2
    data = report.load_data()
    status = 0
    for root, label, kind in sources:
        entry = verify.verify(root, label, kind)
        bad = verify.failures(entry)
        print(f"{label} ({kind}): {'OK' if not bad else 'FAILED'}")
        for line in bad:
            print(f"  {line}")
            status = 1
        if args.check:
            stored = data["versions"].get(label)
            if stored != entry:
                where = report.DATA.relative_to(report.REPO)
                print(f"  differs from {where} (rerun with --write-data)")
                status = 1
        if args.write_data:
            data["versions"][label] = entry
    if args.write_data:
        report.save_data(data)
    if args.write_docs:
        report.write_docs(report.load_data())
    return status


if __name__ == "__main__":
    sys.exit(main())
