"""The checks runner: each :class:`ucm_patch.source_checks.Check` kind evaluated on a
source tree.

A library adds the kinds that need its own names (vLLM-Ascend's hook module, its KV-write
ops) by passing more evaluators to :func:`run_check`; the kinds every library shares are
:data:`GENERIC`. Also here: the version a record's range is tested against, the same way
:mod:`ucm_patch.versions` gates at run time.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping

from packaging.version import Version

from tools.verify.source import SourceTree, calls, local_expr, params
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    from ucm_patch.records import PatchRecord
    from ucm_patch.source_checks import Check

    Evaluator: TypeAlias = Callable[..., str | None]


def signature(tree: SourceTree, code: str, want: tuple[str, ...]) -> str | None:
    fn = tree.find(code)
    if fn is None:
        return f"{code} does not exist"
    got = params(fn)
    return (
        None if tuple(got) == tuple(want) else f"{code} has parameters {got}, expected {list(want)}"
    )


def assigned(tree: SourceTree, module: str, target: str, value: str) -> str | None:
    text = f"{target} = {value}"
    return None if text in tree.assignments(module) else f"{module} has no module-level `{text}`"


def local(tree: SourceTree, code: str, name: str, expr: str) -> str | None:
    fn = tree.find(code)
    if fn is None:
        return f"{code} does not exist"
    got = local_expr(fn, name)
    return None if got == expr else f"{code}: {name} = {got!r}, expected {expr!r}"


def anonymous_only(tree: SourceTree, module: str, name: str) -> str | None:
    mod = tree.module(module)
    if mod is None:
        return f"{module} does not exist"
    texts = [ast.unparse(x) for x in calls(mod, name)]
    bad = [t for t in texts if t != f"{name}('', [])"]
    if not texts:
        return f"{module} never calls {name}"
    return None if not bad else f"{module} calls {name} with a real layer: {bad}"


GENERIC: dict[str, Evaluator] = {
    "signature": signature,
    "assigned": assigned,
    "local": local,
    "anonymous_only": anonymous_only,
}


def run_check(
    tree: SourceTree, check: Check, kinds: Mapping[str, Evaluator] = GENERIC
) -> str | None:
    """None when ``check`` holds in ``tree``, else the reason."""
    evaluate = kinds.get(check.kind)
    if evaluate is None:
        raise ValueError(f"unknown check kind {check.kind!r} in {check}")
    return evaluate(tree, *check.args)


def gated(label: str) -> Version:
    """The version a record's range is tested against (rc / post / local -> base release)."""
    return Version(Version(label.lstrip("v")).base_version)


def in_range(record: PatchRecord, distribution: str, label: str) -> bool:
    return record.specifiers[distribution].contains(gated(label), prereleases=True)
