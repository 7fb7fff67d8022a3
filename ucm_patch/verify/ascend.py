"""vLLM-Ascend: every vLLM-Ascend patch record against the real vLLM-Ascend source of each version.

The source is *read* with ``ast``, never imported (torch-npu cannot run here);
``scripts/verify_ascend_targets.py`` is the command line. Sources:

* PyPI releases (:data:`PYPI`): downloaded with ``pip download --no-deps`` into
  ``.cache/vllm_ascend/dist`` (x86_64 cp311 wheels for 0.11.0 - 0.23.0; the 0.23.0.post1
  sdist needs ``SOC_VERSION=ascend910b1`` and ``--no-build-isolation`` with setuptools_scm,
  so it is fetched from a small venv under ``.cache/vllm_ascend/dlvenv``) and unpacked into
  ``.cache/vllm_ascend/src/<version>``. ``make test`` does this
  (tests/test_patches_ascend_sources.py): these are the cells marked "CI".
* A source checkout of an rc tag, or a tag exported from a local clone (``git archive``).
  Verified outside CI; the results are kept in the data file.

For each version every record whose ``requires`` range contains it (the version gated the
way ``ucm_patch.versions`` gates: rc / post releases as their base release) must satisfy
the checks in its ``expect`` (:mod:`ucm_patch.expect`, with the vLLM-Ascend names of
``ucm_patch.patches.vllm_ascend.checks``). On top, completeness checks scan the whole tree:
every by-name binding of the wait/save hooks has a record, every GDN core that can run (and
every copy vLLM-Ascend makes of one) is wrapped, every function that marks a KV write is
covered or listed in ``NOT_COVERED`` with the reason.

Outputs: ``scripts/data/ascend_signatures.json`` (the facts and results per version, which
the tests compare the stand-ins against) and the ``ascend-matrix`` section of
docs/PATCHES.md.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

from ucm_patch.typing_guard import TYPE_CHECKING
from ucm_patch.verify import checks, sections
from ucm_patch.verify.source import (
    SourceTree,
    calls,
    local_expr,
    module_level,
    params,
    resolve_from,
)

if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

    from ucm_patch.expect import Check
    from ucm_patch.records import PatchRecord


REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "scripts" / "data" / "ascend_signatures.json"
DOC = REPO / "docs" / "PATCHES.md"
CACHE = REPO / ".cache" / "vllm_ascend"
SECTION = "ascend-matrix"
MARK_START, MARK_END = sections.markers(SECTION)

# PyPI releases verified in CI: version -> how pip gets it.
PYPI: dict[str, str] = {
    "0.11.0": "wheel",
    "0.13.0": "wheel",
    "0.18.0": "wheel",
    "0.23.0": "wheel",
    "0.23.0.post1": "sdist",
}
WHEEL_PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux2014_x86_64",
)
PIP_TIMEOUT_S = 900

# Writers of the KV cache (functions that record reshape_cache_event or call
# notify_kv_cache_written) that reshape_cache_event deliberately leaves alone, and why.
_SFA_WHY = (
    "SFA writes inline (forward, or the indexer's post-process up to 0.15) and records the "
    "event natively for producers in every version; a non-producer has no hook point "
    "between the write and the save"
)
NOT_COVERED: dict[str, str] = {
    "vllm_ascend.attention.sfa_v1:AscendSFAImpl.forward": _SFA_WHY,
    "vllm_ascend.attention.sfa_v1:AscendSFAImpl.indexer_select_post_process": _SFA_WHY,
    "vllm_ascend.attention.context_parallel.sfa_cp:AscendSFACPImpl.indexer_select_post_process": (
        _SFA_WHY
    ),
}
GDN_METHODS = ("_forward_core", "_forward")


@functools.cache
def records() -> tuple[PatchRecord, ...]:
    """Every vLLM-Ascend record (imported on first use: the engine itself imports no patch)."""
    from ucm_patch.patches.vllm_ascend import PATCH_SETS

    return tuple(r for ps in PATCH_SETS for r in ps.records)


def expectations() -> dict[str, tuple[Check, ...]]:
    """Record id -> what the record relies on in the vLLM-Ascend source."""
    return {r.id: r.expect for r in records()}


def _c() -> ModuleType:
    """The vLLM-Ascend names the checks use (and the shared check constructors)."""
    from ucm_patch.patches.vllm_ascend import checks as names

    return names


def __getattr__(name: str) -> Any:
    """``RECORDS``, ``EXPECT`` and ``C`` for readers of this module, loaded on first use."""
    if name == "RECORDS":
        return list(records())
    if name == "EXPECT":
        return expectations()
    if name == "C":
        return _c()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- acquiring sources --------------------------------------------------------------------
class SourceError(RuntimeError):
    """A source could not be downloaded or unpacked; the message says what to do."""


def _pip_failure(version: str, proc: subprocess.CompletedProcess[str]) -> SourceError:
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return SourceError(
        f"pip could not download vllm-ascend=={version} (exit {proc.returncode}). The check "
        f"needs https://pypi.org, or the file already in {CACHE / 'dist'}.\n{tail}"
    )


def _run_pip(cmd: list[str], version: str, env: dict[str, str] | None = None) -> None:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SourceError(
            f"pip download of vllm-ascend=={version} took more than {PIP_TIMEOUT_S}s; "
            f"check the network to https://pypi.org (command: {' '.join(cmd)})"
        ) from exc
    if proc.returncode != 0:
        raise _pip_failure(version, proc)


def _download_venv() -> Path:
    """A venv with setuptools_scm for the sdist's metadata step (pip needs it, no isolation)."""
    path = CACHE / "dlvenv"
    py = path / "bin" / "python"
    if not (path / ".ready").exists():
        if path.exists():
            shutil.rmtree(path)
        venv.EnvBuilder(with_pip=True).create(path)
        _run_pip(
            [str(py), "-m", "pip", "install", "-q", "setuptools_scm", "setuptools>=68", "wheel"],
            "(setuptools_scm for the sdist)",
        )
        (path / ".ready").write_text("ok\n")
    return py


def _find_dist(version: str) -> Path | None:
    dist = CACHE / "dist"
    if not dist.is_dir():
        return None
    for f in sorted(dist.iterdir()):
        if f.name.startswith(f"vllm_ascend-{version}-") and f.suffix == ".whl":
            return f
        if f.name == f"vllm_ascend-{version}.tar.gz":
            return f
    return None


def download(version: str) -> Path:
    """The downloaded wheel / sdist of ``version`` (cached in .cache/vllm_ascend/dist)."""
    if version not in PYPI:
        raise SourceError(f"vllm-ascend {version} is not one of the PyPI releases {sorted(PYPI)}")
    found = _find_dist(version)
    if found is not None:
        return found
    dist = CACHE / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    req = f"vllm-ascend=={version}"
    if PYPI[version] == "wheel":
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", req, "-d", str(dist)]
        cmd += ["--only-binary=:all:", "--python-version", "3.11"]
        for platform in WHEEL_PLATFORMS:
            cmd += ["--platform", platform]
        _run_pip(cmd, version)
    else:
        py = _download_venv()
        env = {**os.environ, "SOC_VERSION": "ascend910b1"}
        cmd = [str(py), "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation"]
        cmd += ["--no-binary=:all:", req, "-d", str(dist)]
        _run_pip(cmd, version, env=env)
    found = _find_dist(version)
    if found is None:
        raise SourceError(f"pip reported success but no vllm-ascend {version} file is in {dist}")
    return found


def unpack(archive: Path, version: str) -> Path:
    """Unpack a wheel / sdist into .cache/vllm_ascend/src/<version>; returns that root."""
    root = CACHE / "src" / version
    if (root / "vllm_ascend" / "__init__.py").exists():
        return root
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        inner = [p for p in tmp.iterdir() if (p / "vllm_ascend").is_dir()]
        if len(inner) != 1:
            raise SourceError(f"{archive} does not contain one top folder with vllm_ascend/")
        for p in inner[0].iterdir():
            p.rename(tmp / p.name)
        inner[0].rmdir()
    if not (tmp / "vllm_ascend" / "__init__.py").exists():
        raise SourceError(f"{archive} has no vllm_ascend/__init__.py")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def export_tag(git_dir: Path, tag: str) -> Path:
    """``git archive <tag> vllm_ascend`` from a local clone into .cache/vllm_ascend/src/<tag>
    (``tag`` may be any commit: a main-branch snapshot is exported the same way)."""
    root = CACHE / "src" / tag
    if (root / "vllm_ascend" / "__init__.py").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", tag, "vllm_ascend"],
        capture_output=True,
        check=False,
        timeout=300,
    )
    if archive.returncode != 0:
        raise SourceError(
            f"git archive {tag} failed in {git_dir}: {archive.stderr.decode()[-500:]}"
        )
    subprocess.run(["tar", "x", "-C", str(root)], input=archive.stdout, check=True)
    return root


# -- reading the source -------------------------------------------------------------------
class Tree(SourceTree):
    """The parsed ``vllm_ascend`` package of one version (modules parsed on first use)."""

    def __init__(self, root: Path) -> None:
        if not (root / "vllm_ascend").is_dir():
            raise SourceError(f"{root} has no vllm_ascend/ folder")
        super().__init__(root, "vllm_ascend")
        self.bindings: tuple[set[tuple[str, str]], list[str]] | None = None


def _self_callees(tree: Tree, code: str, fn: ast.FunctionDef) -> list[tuple[str, ast.FunctionDef]]:
    """``self.method(...)`` calls of ``fn`` resolved in the same class (one level)."""
    module, _, qual = code.partition(":")
    cls = qual.rsplit(".", 1)[0] if "." in qual else ""
    out = []
    for call in ast.walk(fn):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
            and cls
        ):
            callee_code = f"{module}:{cls}.{call.func.attr}"
            callee = tree.find(callee_code)
            if callee is not None:
                out.append((callee_code, callee))
    return out


def _is_event_assign(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Assign)
        and any(
            isinstance(t, ast.Attribute) and t.attr == "reshape_cache_event" for t in node.targets
        )
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func).endswith("npu.Event")
    )


def native_event(tree: Tree, code: str) -> str:
    """Condition under which ``code`` (or a self-callee) creates reshape_cache_event, or 'none'."""
    fn = tree.find(code)
    if fn is None:
        return "missing"
    found: list[str] = []
    for _, f in [(code, fn), *_self_callees(tree, code, fn)]:
        _conditions(f, [], found)
    return " | ".join(dict.fromkeys(found)) if found else "none"


def _conditions(node: ast.AST, stack: list[str], found: list[str]) -> None:
    if _is_event_assign(node):
        found.append(" and ".join(stack) or "always")
        return
    if isinstance(node, ast.If):
        test = ast.unparse(node.test)
        for ch in node.body:
            _conditions(ch, [*stack, test], found)
        for ch in node.orelse:
            _conditions(ch, [*stack, f"not ({test})"], found)
        return
    for ch in ast.iter_child_nodes(node):
        if not isinstance(ch, (ast.FunctionDef, ast.ClassDef, ast.Lambda)):
            _conditions(ch, stack, found)


def marks_write(fn: ast.FunctionDef) -> bool:
    for n in ast.walk(fn):
        if _is_event_assign(n):
            return True
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name == _c().NOTIFY or name in _c().KV_WRITE_OPS:
                return True
            if name == "record" and ast.unparse(n.func).endswith("reshape_cache_event.record"):
                return True
    return False


def marks_write_marker(fn: ast.FunctionDef) -> bool:
    """Records reshape_cache_event or calls notify_kv_cache_written (not plain write ops)."""
    return any(_is_event_assign(n) for n in ast.walk(fn)) or bool(calls(fn, _c().NOTIFY))


def mlapo(fn: ast.FunctionDef) -> dict[str, bool] | None:
    """For SFA forward: does the enable_mlapo branch wait, does another branch wait."""
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and "enable_mlapo" in ast.unparse(n.test):
            body = ast.Module(body=n.body, type_ignores=[])
            orelse = ast.Module(body=n.orelse, type_ignores=[])
            return {
                "mlapo_branch_waits": bool(calls(body, _c().WAIT)),
                "other_branch_waits": bool(calls(orelse, _c().WAIT)),
            }
    return None


# -- checks ---------------------------------------------------------------------------------
def _binding(tree: Tree, module: str, name: str) -> str | None:
    src = tree.imports_by_name(module).get(name)
    utils = _c().UTILS
    return None if src == utils else f"{module} does not import {name} from {utils} ({src})"


def _marks_write(tree: Tree, code: str) -> str | None:
    fn = tree.find(code)
    if fn is None:
        return f"{code} does not exist"
    if marks_write(fn) or any(marks_write(f) for _, f in _self_callees(tree, code, fn)):
        return None
    return f"{code} neither writes the KV cache nor marks a write"


def _mlapo_no_wait(tree: Tree, code: str) -> str | None:
    fn = tree.find(code)
    if fn is None:
        return f"{code} does not exist"
    m = mlapo(fn)
    if m is None:
        return f"{code} has no enable_mlapo branch"
    if m["mlapo_branch_waits"] or not m["other_branch_waits"]:
        waits, other = m["mlapo_branch_waits"], m["other_branch_waits"]
        return f"{code}: mlapo branch waits={waits}, other={other}"
    return None


KINDS = {
    **checks.GENERIC,
    "binding": _binding,
    "marks_write": _marks_write,
    "mlapo_no_wait": _mlapo_no_wait,
}


def run_check(tree: Tree, check: Check) -> str | None:
    """None when ``check`` holds in ``tree``, else the reason."""
    return checks.run_check(tree, check, KINDS)


MAIN_PREFIX = "main@"  # label of a main-branch snapshot: "main@<commit[:12]>"


def main_label(commit: str) -> str:
    return f"{MAIN_PREFIX}{commit[:12]}"


def is_main(label: str) -> bool:
    return label.startswith(MAIN_PREFIX)


def in_range(record: PatchRecord, label: str) -> bool:
    """Whether ``record`` applies to the source labelled ``label``. A main-branch snapshot
    is newer than every ceiling: what would run there is the newest era of each patch (the
    records ``UCM_PATCH_ALLOW_UNTESTED`` lets apply), so those are the ones checked."""
    if is_main(label):
        return not record.retired and record.id in _newest_ids()
    return checks.in_range(record, "vllm-ascend", label)


@functools.cache
def _newest_ids() -> frozenset[str]:
    from ucm_patch.records import newest_eras

    return frozenset(newest_eras(records()))


# -- completeness ---------------------------------------------------------------------------
def hook_bindings_everywhere(tree: Tree) -> tuple[set[tuple[str, str]], list[str]]:
    """All by-name bindings of wait/save, and problems (function-level imports, attr calls)."""
    if tree.bindings is not None:
        return tree.bindings
    found: set[tuple[str, str]] = set()
    problems: list[str] = []
    for module in tree.mentioning(_c().WAIT, _c().SAVE):
        mod = tree.module(module)
        if mod is None:
            continue
        top = {id(s) for s in module_level(mod)}
        is_pkg = tree.is_package(module)
        for node in ast.walk(mod):
            if (
                isinstance(node, ast.ImportFrom)
                and resolve_from(module, node, is_pkg) == _c().UTILS
            ):
                for alias in node.names:
                    if alias.name in (_c().WAIT, _c().SAVE):
                        if id(node) in top:
                            found.add((module, alias.asname or alias.name))
                        else:
                            problems.append(f"{module} imports {alias.name} inside a function")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in (_c().WAIT, _c().SAVE)
            ):
                problems.append(f"{module} calls {ast.unparse(node.func)} through a module")
    tree.bindings = (found, problems)
    return tree.bindings


def completeness(tree: Tree, label: str) -> dict[str, str]:
    live = [r for r in records() if in_range(r, label)]
    out: dict[str, str] = {}

    # 1. every by-name binding of the wait/save hooks has an ascend_hook_bindings record
    found, problems = hook_bindings_everywhere(tree)
    wanted = {(r.module, r.qualname) for r in live if r.name == "ascend_hook_bindings"}
    missing = sorted(f"{m}:{n}" for m, n in found - wanted)
    extra = sorted(f"{m}:{n}" for m, n in wanted - found)
    issues = problems + [f"unpatched binding {x}" for x in missing]
    issues += [f"record for absent binding {x}" for x in extra]
    out["hook_bindings"] = "; ".join(issues) or f"ok ({len(found)} bindings)"

    # 2. every anonymous GDN save goes through a filtered binding
    anon_modules = set()
    for module in tree.mentioning(_c().SAVE):
        mod = tree.module(module)
        if mod is not None and any(
            ast.unparse(x) == f"{_c().SAVE}('', [])" for x in calls(mod, _c().SAVE)
        ):
            anon_modules.add(module)
    filtered = {r.module for r in live if r.name == "gdn_layerwise" and r.qualname == _c().SAVE}
    gaps = sorted(anon_modules - filtered) + [
        f"{m} (filter, no call)" for m in sorted(filtered - anon_modules)
    ]
    out["gdn_anonymous"] = "; ".join(gaps) or f"ok ({len(anon_modules)} modules)"

    # 3. every GDN core and every copy of one is wrapped
    out["gdn_cores"] = _gdn_cores(tree, live)

    # 4. every function marking a KV write is covered by reshape_cache_event (or NOT_COVERED)
    out["kv_writers"] = _kv_writers(tree, live)
    return out


def _gdn_cores(tree: Tree, live: list[Any]) -> str:
    gdn = [r for r in live if r.name == "gdn_layerwise" and r.qualname != _c().SAVE]
    targets = {r.target for r in gdn}
    copied_from: set[str] = set()
    for r in gdn:
        for chk in r.expect:
            if chk.kind == "assigned":
                module, _, value = chk.args
                cls = value.split(".")[0]
                src = tree.imports_by_name(module).get(cls, module)
                copied_from.add(f"{src}:{value}")
    issues = []
    cores = 0
    for module in tree.mentioning("GatedDeltaNet", "GDN"):
        mod = tree.module(module)
        if mod is None:
            continue
        for cls in (
            n for n in mod.body if isinstance(n, ast.ClassDef) and "GatedDeltaNet" in n.name
        ):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in GDN_METHODS:
                    if fn.name == "_forward" and params(fn) != ["self", "hidden_states", "output"]:
                        continue
                    code = f"{module}:{cls.name}.{fn.name}"
                    cores += 1
                    if code not in targets and code not in copied_from:
                        issues.append(f"GDN core {code} is not wrapped")
        for text in tree.assignments(module):
            lhs = text.split(" = ")[0]
            owner, _, method = lhs.rpartition(".")
            is_gdn = "GatedDeltaNet" in owner or "GDN" in owner
            if is_gdn and method in GDN_METHODS and f"{module}:{lhs}" not in targets:
                issues.append(f"copy `{text}` in {module} is not wrapped")
    return "; ".join(issues) or f"ok ({cores} cores)"


def _kv_writers(tree: Tree, live: list[Any]) -> str:
    rce = [r for r in live if r.name == "reshape_cache_event"]
    direct = {r.target for r in rce if r.qualname != _c().NOTIFY}
    notify_modules = {r.module for r in rce if r.qualname == _c().NOTIFY}
    callee_names: set[str] = set()
    for target in direct:
        fn = tree.find(target)
        if fn is not None:
            callee_names |= {code.rsplit(".", 1)[-1] for code, _ in _self_callees(tree, target, fn)}
    issues = []
    writers = 0
    for module in tree.mentioning("reshape_cache_event", _c().NOTIFY):
        if not module.startswith("vllm_ascend.attention"):
            continue
        mod = tree.module(module)
        if mod is None:
            continue
        for cls in (n for n in mod.body if isinstance(n, ast.ClassDef)):
            for fn in (f for f in cls.body if isinstance(f, ast.FunctionDef)):
                if not marks_write_marker(fn):
                    continue
                writers += 1
                code = f"{module}:{cls.name}.{fn.name}"
                if code in direct or code in NOT_COVERED:
                    continue
                if fn.name in callee_names:
                    continue  # called as self.<name>() by a wrapped method
                only_notify = not any(_is_event_assign(n) for n in ast.walk(fn))
                if only_notify and module in notify_modules:
                    continue
                issues.append(f"KV writer {code} is not covered")
    return "; ".join(issues) or f"ok ({writers} writers)"


# -- one version ----------------------------------------------------------------------------
def referenced_codes() -> list[str]:
    codes: set[str] = set()
    for expect in expectations().values():
        for chk in expect:
            if chk.kind in ("signature", "local", "marks_write", "mlapo_no_wait"):
                codes.add(chk.args[0])
    return sorted(codes)


def verify(root: Path, label: str, kind: str) -> dict[str, Any]:
    """Facts and results for one vLLM-Ascend source tree."""
    tree = Tree(root)
    facts: dict[str, Any] = {"signatures": {}, "native_event": {}, "locals": {}, "mlapo": {}}
    for code in referenced_codes():
        fn = tree.find(code)
        facts["signatures"][code] = params(fn) if fn else None
    for expect in expectations().values():
        for chk in expect:
            if chk.kind == "marks_write":
                facts["native_event"][chk.args[0]] = native_event(tree, chk.args[0])
            if chk.kind == "local":
                fn = tree.find(chk.args[0])
                facts["locals"][chk.args[0]] = local_expr(fn, chk.args[1]) if fn else None
            if chk.kind == "mlapo_no_wait":
                fn = tree.find(chk.args[0])
                facts["mlapo"][chk.args[0]] = mlapo(fn) if fn else None
    for code in NOT_COVERED:
        facts["native_event"][code] = native_event(tree, code)
    found, _ = hook_bindings_everywhere(tree)
    facts["bindings"] = sorted(f"{m}:{n}" for m, n in found)
    results: dict[str, str] = {}
    for r in records():
        if not in_range(r, label):
            results[r.id] = "out of range"
            continue
        reasons = [why for chk in r.expect if (why := run_check(tree, chk)) is not None]
        results[r.id] = "FAIL: " + "; ".join(reasons) if reasons else "ok"
    return {
        "label": label,
        "kind": kind,
        "ci": kind in ("pypi-wheel", "pypi-sdist"),
        "gated_as": "newest eras (untested-version)"
        if is_main(label)
        else str(checks.gated(label)),
        "facts": facts,
        "results": results,
        "completeness": completeness(tree, label),
    }


def failures(entry: dict[str, Any]) -> list[str]:
    out = [f"{rid}: {res}" for rid, res in entry["results"].items() if res.startswith("FAIL")]
    out += [f"{k}: {v}" for k, v in entry["completeness"].items() if not v.startswith("ok")]
    return out


# -- data file and docs ---------------------------------------------------------------------
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
    ("GDN core", "gdn_layerwise", lambda r: r.qualname != _c().SAVE),
    ("GDN anonymous-save filter", "gdn_layerwise", lambda r: r.qualname == _c().SAVE),
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
        "inside `layerwise.begin` and stands aside (one wait, one save).",
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
