"""vLLM-Ascend results of :mod:`tools.verify.ascend`: the data file and the docs matrix.

``scripts/data/ascend_signatures.json`` keeps, per version, the source facts the records
rely on and the check results (the tests compare the stand-ins against it); the
``ascend-matrix`` section of docs/PATCHES.md is rendered from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.verify import sections
from tools.verify.ascend import NOT_COVERED, is_main, names, records

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "scripts" / "data" / "ascend_signatures.json"
DOC = REPO / "docs" / "PATCHES.md"
SECTION = "ascend-matrix"
MARK_START, MARK_END = sections.markers(SECTION)


def _sort_key(label: str) -> tuple[Any, str]:
    from packaging.version import Version

    return (Version("999999") if is_main(label) else Version(label.lstrip("v")), label)


def load_data() -> dict[str, Any]:
    if not DATA.exists():
        return {"versions": {}}
    return json.loads(DATA.read_text(encoding="utf-8"))


def save_data(data: dict[str, Any]) -> None:
    data["versions"] = {k: data["versions"][k] for k in sorted(data["versions"], key=_sort_key)}
    data["about"] = (
        "Written by scripts/verify_ascend_targets.py --write-data: per vLLM-Ascend version, the "
        "source facts the vLLM-Ascend patch records rely on and the check results."
    )
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


ROWS: tuple[tuple[str, str, Any], ...] = (
    ("GDN core", "gdn_layerwise", lambda r: r.qualname != names().SAVE),
    ("GDN anonymous-save filter", "gdn_layerwise", lambda r: r.qualname == names().SAVE),
    ("reshape_cache_event", "reshape_cache_event", lambda r: True),
    ("hook bindings", "ascend_hook_bindings", lambda r: True),
    ("SFA mlapo wait", "ascend_sfa_wait", lambda r: True),
)
SOURCE_TEXT = {
    "pypi-wheel": "PyPI wheel, **CI**",
    "pypi-sdist": "PyPI sdist, **CI**",
    "tag": "git tag, outside CI",
    "main": "main branch at this commit, outside CI",
}


def _cell(entry: dict[str, Any], name: str, pick: Any) -> str:
    recs = [r for r in records() if r.name == name and pick(r)]
    live = [r for r in recs if entry["results"][r.id] != "out of range"]
    if not live:
        return "—"
    bad = [r for r in live if entry["results"][r.id] != "ok"]
    if bad:
        return "✗ " + ", ".join(f"`{r.era}`" for r in bad)
    if name == "ascend_hook_bindings":
        return f"✓ {len(live)} bindings"
    return "✓ " + ", ".join(f"`{r.era}`" for r in live)


def _native(entry: dict[str, Any]) -> str:
    ne = entry["facts"]["native_event"]
    parts = []
    for label, code in (
        ("attn", "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.reshape_and_cache"),
        ("MLA", "vllm_ascend.attention.mla_v1:AscendMLAImpl._mla_preprocess"),
        ("SFA", "vllm_ascend.attention.sfa_v1:AscendSFAImpl.forward"),
    ):
        cond = ne.get(code, "missing")
        if cond == "missing":
            continue
        short = (
            cond.replace("len(kv_cache) > 1 and ", "")
            .replace("kv_cache is not None and ", "")
            .replace("self.", "")
        )
        parts.append(f"{label}: {short}")
    return "; ".join(parts) or "—"


def _not_covered() -> str:
    by_reason: dict[str, list[str]] = {}
    for code, why in NOT_COVERED.items():
        by_reason.setdefault(why, []).append(f"`{code.partition(':')[2]}`")
    return "; ".join(f"{', '.join(codes)}: {why}" for why, codes in by_reason.items())


def render_section(data: dict[str, Any]) -> str:
    """The ``ascend-matrix`` section of docs/PATCHES.md, markers included."""
    return "\n".join([MARK_START, _section_body(data), MARK_END])


def _section_body(data: dict[str, Any]) -> str:
    # json.dumps(sort_keys=True) stores labels alphabetically ("v0.14.0rc1" after "0.23.0")
    versions = [data["versions"][k] for k in sorted(data["versions"], key=_sort_key)]
    head = (
        "| vLLM-Ascend | source | "
        + " | ".join(r[0] for r in ROWS)
        + " | completeness | upstream event |"
    )
    lines = [
        "## vLLM-Ascend verification matrix",
        "",
        "<!-- Written by scripts/verify_ascend_targets.py --write-docs from "
        "scripts/data/ascend_signatures.json; tests/test_patches_ascend_sources.py fails when "
        "it is stale. -->",
        "",
        "Each vLLM-Ascend record is checked against the real vLLM-Ascend source of every "
        "version below (read with `ast`, never imported): its target and signature, the "
        "statement that copies a GDN core onto vLLM's class, the expression picking the GDN "
        "KV cache, the by-name imports of the hook functions. Completeness checks scan the "
        "whole tree: every by-name binding of the wait/save hooks, every GDN core and every "
        "copy of one, every function marking a KV write is covered (or listed, with the "
        "reason, in `NOT_COVERED`). **CI** rows are the PyPI releases, downloaded and "
        "re-verified by `make test`; *outside CI* rows were verified against the public "
        "source of the rc tag (`--git REPO --tag TAG`) and are kept in the data file. "
        "A `main@<commit>` row is the public main branch at that commit (`--git REPO --main "
        "COMMIT`): newer than every ceiling, so it is checked against the newest era of "
        "each patch, the records `UCM_PATCH_ALLOW_UNTESTED` lets apply there; a ✗ in it is "
        "a record that would stop at its apply-time check (`failed`, 'signature changed').",
        "",
        "Gating: every record requires `vllm-ascend` only. vLLM-Ascend X pairs vLLM X; when "
        "the installed major.minor differ (nightly images report a stale vLLM-Ascend "
        "version) **the installed vLLM wins**: the vLLM-Ascend records are gated as the "
        "paired release of the installed vLLM (`ucm_patch.versions.align_ascend`), and "
        "`ucm-patch status` shows `vllm-ascend <raw> (gated as <vLLM>); mismatch: ...` in "
        "the installed column. `UCM_PATCH_VLLM_ASCEND_VERSION` forces a version (no "
        "alignment). rc and post releases gate as their base release.",
        "",
        "Cells: ✓ and the eras applied; — no record in range; ✗ a check failed. "
        "*upstream event*: when vLLM-Ascend itself creates `reshape_cache_event` "
        "(`none`: never; `reshape_cache_event` fills the gaps).",
        "",
        head,
        "|" + "---|" * (len(ROWS) + 4),
    ]
    for e in versions:
        comp = "✓" if all(v.startswith("ok") for v in e["completeness"].values()) else "✗"
        cells = [_cell(e, name, pick) for _, name, pick in ROWS]
        lines.append(
            f"| {e['label']} | {SOURCE_TEXT[e['kind']]} | "
            + " | ".join(cells)
            + f" | {comp} | {_native(e)} |"
        )
    lines += [
        "",
        "Not covered on purpose: " + _not_covered() + ". vLLM-Ascend 0.12 (rc only) is "
        "outside every range; from 0.26 the newest eras are `untested-version` (off unless "
        "allowed).",
        "",
        "GDN on an NPU host: vLLM's own `gdn_layerwise` eras are in range too, but vLLM-Ascend "
        "overwrites (0.13-0.18, 0.21+) or overrides (0.11, 0.19-0.20) the method they wrap, so "
        "`ucm-patch status` may list one as applied while only the vLLM-Ascend era's wrapper "
        "runs; where both end up nested on one method, the inner one finds the layer already "
        "inside the layer bracket (`layerwise.layer_bracket`) and stands aside (one wait, "
        "one save).",
        "",
        "Behaviour without an NPU: tests/test_patches_ascend_eras.py runs each era's records "
        "through the real registry on stand-in vLLM-Ascend packages (tests/standins, checked "
        "against this data by tests/test_patches_ascend_standins.py) with a fake torch_npu. "
        "NPU-only code is `patches/vllm_ascend/_npu.py` (`torch.npu.Event`) and "
        "`hooks/device_npu.py` (raw handles, `acl.rt`); on an Ascend host run "
        "`python -m ucm_patch.patches.vllm_ascend._npu` and "
        '`python -c "from ucm_patch.hooks.device_npu import self_check; print(self_check())"`.',
        "",
        "Regenerate: `python scripts/verify_ascend_targets.py --pypi all --write-data "
        "--write-docs` (and `--git <clone> --tag <rc> --write-data` for an rc tag).",
    ]
    return "\n".join(lines)


def write_docs(data: dict[str, Any]) -> None:
    sections.write_section(DOC, SECTION, _section_body(data))


def doc_section() -> str | None:
    """The section as docs/PATCHES.md has it now, markers included (None when absent)."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    start, end = text.find(MARK_START), text.find(MARK_END)
    return text[start : end + len(MARK_END)] if start >= 0 and end > start else None
