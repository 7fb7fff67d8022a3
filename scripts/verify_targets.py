"""Check every vLLM patch record's target and signature against real vLLM sources.

Sources are read with ``ast``, never imported, so one machine checks every release (the
engine is :mod:`tools.verify.vllm`; this is its command line):

* ``--download``: ``pip download --no-deps`` the wheel of every supported version into
  ``.cache/wheels``, keep only ``vllm/**/*.py`` under ``.cache/vllm-src/<dist>-<ver>``
  and delete the wheel.
* ``--extract``: read those sources and write ``scripts/data/vllm_signatures.json`` (each
  record target's parameters and decorators per version, op registrations, the version
  facts the wrappers depend on). The file is committed, so CI and the per-era unit tests
  need no wheel.
* ``--matrix``: the patch x version matrix (applies / not applicable / broken) from that
  file, written into docs/PATCHES.md between ``<!-- verify-matrix:start -->`` and
  ``<!-- verify-matrix:end -->`` (the doc generator carries that section over).
* ``--survey``: custom ops and layers of vLLM 0.22+ that own a KV cache and bypass
  ``maybe_transfer_kv_layer``, written into the ``bypass-survey`` section; and every KV-cache
  write site of vLLM 0.33 for ``kv_ready_event`` (scripts/survey_kv_writes.py), written into
  ``scripts/data/kv_write_sites.json`` and the ``kv-write-survey`` section.
* ``--installed`` (default): the same check against the installed vLLM (located with
  ``importlib.util.find_spec``, not imported); exit status 1 if a record is broken.
  ``make test`` runs it through tests/test_patches_vllm_targets.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed
from tools.verify import vllm as verify


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--download", action="store_true")
    ap.add_argument("--extract", action="store_true")
    ap.add_argument("--matrix", action="store_true")
    ap.add_argument("--survey", action="store_true")
    ap.add_argument("--installed", action="store_true")
    args = ap.parse_args(argv)
    if not any(vars(args).values()):
        args.installed = True
    if args.download:
        verify.download()
    data = verify.extract() if args.extract else None
    rc = 0
    doc = verify.DOC.relative_to(verify.REPO)
    if args.matrix:
        data = data or json.loads(verify.DATA.read_text())
        text, n_broken = verify.matrix(data)
        verify.write_section("verify-matrix", text)
        print(f"wrote the verify-matrix section of {doc} ({n_broken} broken)")
        rc |= int(n_broken > 0)
    if args.survey:
        from survey_bypass import survey_markdown  # scripts/survey_bypass.py

        verify.write_section("bypass-survey", survey_markdown(verify.SRC))
        print(f"wrote the bypass-survey section of {doc}")
        import survey_kv_writes  # scripts/survey_kv_writes.py

        sites = survey_kv_writes.write_data(verify.SRC)
        verify.write_section(survey_kv_writes.SECTION, survey_kv_writes.survey_markdown(sites))
        where = survey_kv_writes.DATA.relative_to(verify.REPO)
        print(f"wrote {where} and the kv-write-survey section of {doc}")
    if args.installed:
        for rid, status, reason in verify.check_installed():
            print(f"{status:18} {rid} {reason}".rstrip())
            rc |= int(status == verify.BROKEN)
    return rc


if __name__ == "__main__":
    sys.exit(main())
