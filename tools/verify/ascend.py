"""vLLM-Ascend: every vLLM-Ascend patch record against the real vLLM-Ascend source of each version.

The source is *read* with ``ast``, never imported (torch-npu cannot run here);
``scripts/verify_ascend_targets.py`` is the command line. Three modules, one job each:

* :mod:`tools.verify.ascend_sources` gets a version's source: PyPI wheels and the sdist
  (``make test`` does this, tests/test_patches_ascend_sources.py: the cells marked "CI"),
  or a tag / commit exported from a local clone (verified outside CI);
* this module checks it: for each version every record whose ``requires`` range contains
  it (the version gated the way ``ucm_patch.versions`` gates: rc / post releases as their
  base release) must satisfy the checks in its ``expect`` (:mod:`ucm_patch.source_checks`,
  with the vLLM-Ascend names of ``ucm_patch.patches.vllm_ascend.source_names``). On top,
  completeness checks scan the whole tree: every by-name binding of the wait/save hooks
  has a record, every GDN core that can run (and every copy vLLM-Ascend makes of one) is
  wrapped, every function that marks a KV write is covered or listed in ``NOT_COVERED``
  with the reason;
* :mod:`tools.verify.ascend_report` keeps the results: ``scripts/data/ascend_signatures.json``
  (the facts and results per version, which the tests compare the stand-ins against) and
  the ``ascend-matrix`` section of docs/PATCHES.md.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tools.verify import check_runner
from tools.verify.ascend_sources import SourceError
from tools.verify.source import (
    SourceTree,
    calls,
    local_expr,
    module_level,
    params,
    resolve_from,
)
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

    from ucm_patch.records import PatchRecord
    from ucm_patch.source_checks import Check


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


def names() -> ModuleType:
    """The vLLM-Ascend names the checks use (and the shared check constructors)."""
    from ucm_patch.patches.vllm_ascend import source_names as names

    return names


def __getattr__(name: str) -> Any:
    """``RECORDS``, ``EXPECT`` and ``C`` for readers of this module, loaded on first use."""
    if name == "RECORDS":
        return list(records())
    if name == "EXPECT":
        return expectations()
    if name == "C":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            if name == names().NOTIFY or name in names().KV_WRITE_OPS:
                return True
            if name == "record" and ast.unparse(n.func).endswith("reshape_cache_event.record"):
                return True
    return False


def marks_write_marker(fn: ast.FunctionDef) -> bool:
    """Records reshape_cache_event or calls notify_kv_cache_written (not plain write ops)."""
    return any(_is_event_assign(n) for n in ast.walk(fn)) or bool(calls(fn, names().NOTIFY))


def mlapo(fn: ast.FunctionDef) -> dict[str, bool] | None:
    """For SFA forward: does the enable_mlapo branch wait, does another branch wait."""
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and "enable_mlapo" in ast.unparse(n.test):
            body = ast.Module(body=n.body, type_ignores=[])
            orelse = ast.Module(body=n.orelse, type_ignores=[])
            return {
                "mlapo_branch_waits": bool(calls(body, names().WAIT)),
                "other_branch_waits": bool(calls(orelse, names().WAIT)),
            }
    return None


# -- checks ---------------------------------------------------------------------------------
def _binding(tree: Tree, module: str, name: str) -> str | None:
    src = tree.imports_by_name(module).get(name)
    utils = names().UTILS
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
    **check_runner.GENERIC,
    "binding": _binding,
    "marks_write": _marks_write,
    "mlapo_no_wait": _mlapo_no_wait,
}


def run_check(tree: Tree, check: Check) -> str | None:
    """None when ``check`` holds in ``tree``, else the reason."""
    return check_runner.run_check(tree, check, KINDS)


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
    return check_runner.in_range(record, "vllm-ascend", label)


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
    for module in tree.mentioning(names().WAIT, names().SAVE):
        mod = tree.module(module)
        if mod is None:
            continue
        top = {id(s) for s in module_level(mod)}
        is_pkg = tree.is_package(module)
        for node in ast.walk(mod):
            if (
                isinstance(node, ast.ImportFrom)
                and resolve_from(module, node, is_pkg) == names().UTILS
            ):
                for alias in node.names:
                    if alias.name in (names().WAIT, names().SAVE):
                        if id(node) in top:
                            found.add((module, alias.asname or alias.name))
                        else:
                            problems.append(f"{module} imports {alias.name} inside a function")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in (names().WAIT, names().SAVE)
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
    for module in tree.mentioning(names().SAVE):
        mod = tree.module(module)
        if mod is not None and any(
            ast.unparse(x) == f"{names().SAVE}('', [])" for x in calls(mod, names().SAVE)
        ):
            anon_modules.add(module)
    filtered = {r.module for r in live if r.name == "gdn_layerwise" and r.qualname == names().SAVE}
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
    gdn = [r for r in live if r.name == "gdn_layerwise" and r.qualname != names().SAVE]
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
    direct = {r.target for r in rce if r.qualname != names().NOTIFY}
    notify_modules = {r.module for r in rce if r.qualname == names().NOTIFY}
    callee_names: set[str] = set()
    for target in direct:
        fn = tree.find(target)
        if fn is not None:
            callee_names |= {code.rsplit(".", 1)[-1] for code, _ in _self_callees(tree, target, fn)}
    issues = []
    writers = 0
    for module in tree.mentioning("reshape_cache_event", names().NOTIFY):
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
        else str(check_runner.gated(label)),
        "facts": facts,
        "results": results,
        "completeness": completeness(tree, label),
    }


def failures(entry: dict[str, Any]) -> list[str]:
    out = [f"{rid}: {res}" for rid, res in entry["results"].items() if res.startswith("FAIL")]
    out += [f"{k}: {v}" for k, v in entry["completeness"].items() if not v.startswith("ok")]
    return out
