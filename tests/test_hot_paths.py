"""Hot paths stay hot: what runs once per layer per step imports, logs and builds nothing.

The rule ("no allocation, import or logging on that path") is easy to
break with one innocent line: a ``logger.debug``, an f-string, a list built to pass a few
values, a lazy ``import``. A timing benchmark would only notice it on a quiet machine; this
test reads the source of every function on the per-layer path and rejects those
constructs, except inside ``raise`` statements (error paths are not hot).

The list below is the per-layer path end to end: the call-time guard and shims every
record runs through, the layer and KV-write wrappers the vLLM patch sets install, the
``ucm_patch.hooks`` entry points, the connector's worker hooks, and the dump scheduler's
submit with event resolution. The generated trampolines and shims have no source file:
their generated source is checked the same way. Tuples are allowed (a
returned ``(event, owned, source)`` comes from CPython's tuple free list), and so are
integer counters.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.connector_harness import LAYERS, Harness, Req, blocks, new_req
from tests.support.connector_harness import sched_output as so
from ucm_patch import connector, guard, trampoline
from ucm_patch.connector import UCMPatchConnector
from ucm_patch.connector.worker_side import WorkerSide
from ucm_patch.hooks import layerwise
from ucm_patch.hooks.dump import DumpScheduler
from ucm_patch.hooks.events import EventLedger
from ucm_patch.patches.vllm import _layer_hooks, kv_ready_event

#: Node types that allocate a container, define code, or import.
FORBIDDEN: dict[type[ast.AST], str] = {
    ast.Import: "import",
    ast.ImportFrom: "import",
    ast.List: "list display",
    ast.Dict: "dict display",
    ast.Set: "set display",
    ast.ListComp: "list comprehension",
    ast.SetComp: "set comprehension",
    ast.DictComp: "dict comprehension",
    ast.GeneratorExp: "generator expression",
    ast.Lambda: "lambda",
    ast.JoinedStr: "f-string",
    ast.FunctionDef: "nested def",
    ast.AsyncFunctionDef: "nested def",
    ast.ClassDef: "nested class",
}
#: Calls that log, print or import, whatever the receiver.
FORBIDDEN_CALLS = frozenset(
    {"debug", "info", "warning", "warn", "error", "exception", "critical", "log", "print",
     "__import__", "import_module", "format"}
)  # fmt: skip


def _original(x: Any) -> Any:
    return x


def _hot_functions() -> dict[str, Callable[..., Any]]:
    cell = guard.CallCell()
    return {
        "guard (wrapt installer)": guard.make_guard(
            lambda w, i, a, k: w(*a, **k), cell, _original, lambda exc: None, lambda: False
        ),
        "shim (function)": guard.make_shim(_original, cell),
        "shim (method)": guard.make_shim(_original, cell, method=True),
        "layer wrapper (op kernel)": _layer_hooks.make_op_wrapper(4),
        "layer wrapper (method)": _layer_hooks.make_method_wrapper("prefix"),
        "KV-write kernel wrapper": kv_ready_event.make_kv_update_wrapper(2),
        "save-hook wrapper (vLLM 0.11)": kv_ready_event.make_save_hook_wrapper(),
        "layerwise.begin": layerwise.begin,
        "layerwise.enter": layerwise.enter,
        "layerwise.end": layerwise.end,
        "layerwise.wait": layerwise.wait,
        "layerwise.save": layerwise.save,
        "layerwise.kv_ready": layerwise.kv_ready,
        "WorkerSide.wait_for_layer_load": WorkerSide.wait_for_layer_load,
        "WorkerSide.save_kv_layer": WorkerSide.save_kv_layer,
        "WorkerSide._submit_row": WorkerSide._submit_row,
        "DumpScheduler.submit_layer": DumpScheduler.submit_layer,
        "DumpScheduler.submit": DumpScheduler.submit,
        "DumpScheduler._enqueue": DumpScheduler._enqueue,
        "EventLedger.resolve": EventLedger.resolve,
        "EventLedger.count_locked": EventLedger.count_locked,
    }


def violations(func: Callable[..., Any]) -> list[str]:
    """Forbidden constructs in ``func``'s body, outside ``raise`` statements."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    fdef = tree.body[0]
    assert isinstance(fdef, ast.FunctionDef | ast.AsyncFunctionDef), type(fdef)
    return violations_in(fdef)


def violations_in(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    found: list[str] = []
    todo: list[ast.AST] = list(fdef.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Raise):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstring
        kind = FORBIDDEN.get(type(node))
        if kind is not None:
            found.append(f"line {node.lineno}: {kind}")
        if isinstance(node, ast.Call):
            callee = node.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            if name in FORBIDDEN_CALLS:
                found.append(f"line {node.lineno}: call to {name}()")
        todo.extend(ast.iter_child_nodes(node))
    return found


@pytest.mark.parametrize("name", sorted(_hot_functions()))
def test_hot_function_imports_logs_and_builds_nothing(name: str) -> None:
    func = _hot_functions()[name]
    assert violations(func) == [], f"{name} ({inspect.getsourcefile(func)})"


def test_generated_trampolines_build_nothing_for_positional_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trampoline and its shim are compiled from generated source: check that source.

    For targets without keyword-only parameters (every current target) the call hands the
    wrapper one args tuple and the shared empty kwargs dict: no display in the body."""
    sources: list[str] = []
    compile_shape = trampoline._compile_factory.__wrapped__

    def capture(src: str) -> Any:
        sources.append(src)
        return compile_shape(src)

    monkeypatch.setattr(trampoline, "_compile_factory", capture)

    def kernel(mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any, layer_name: Any) -> None:
        return None

    class Layer:
        def _forward_core(self, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> None:
            return None

    for target, method in ((kernel, False), (Layer._forward_core, True)):
        sources.clear()
        trampoline.make_trampoline(
            target,
            lambda w, i, a, k: w(*a, **k),
            bool,
            method,
            guard.CallCell(),
            lambda exc: None,
            lambda: False,
        )
        assert len(sources) == 2, "a shim and a trampoline"
        for src in sources:
            factory = ast.parse(src).body[0]
            assert isinstance(factory, ast.FunctionDef)
            inner = factory.body[0]
            assert isinstance(inner, ast.FunctionDef)
            assert violations_in(inner) == [], src


def test_the_checker_catches_each_construct() -> None:
    # Each construct in its own function: the checker must name every one.
    def bad(x: Any, log: Any) -> Any:
        import os  # noqa: F401

        log.debug("x")
        y = [x]
        z = {x: 1}
        w = f"{x}"
        v = (i for i in y)
        return y, z, w, v

    def fine(x: Any) -> Any:
        if x is None:
            raise ValueError(f"x must not be None, got {x!r}")  # error path: allowed
        return x, x + 1

    found = violations(bad)
    kinds = {entry.split(": ", 1)[1] for entry in found}
    assert kinds == {
        "import",
        "call to debug()",
        "list display",
        "dict display",
        "f-string",
        "generator expression",
    }, found
    assert violations(fine) == []


def test_steps_after_the_first_import_nothing() -> None:
    """The whole worker step (bind, per-layer hooks with dumps, wait_for_save, results)
    imports no module once one step ran: lazy imports belong in set-up, not in steps."""
    h = Harness(UCMPatchConnector)
    tokens = list(range(100, 113))

    def run(rid: str, ids: list[int]) -> None:
        req = Req(rid, tokens)
        h.sched.get_num_new_matched_tokens(req, 0)
        h.sched.update_state_after_alloc(req, blocks(ids), 0)
        h.step(so([new_req(rid, [ids], 0)], scheduled={rid: len(tokens)}))
        assert connector.wait_for_dumps(30.0)

    run("warm-up", [1, 2, 3])
    before = set(sys.modules)
    run("measured", [4, 5, 6])
    saved = h.worker._worker_side.save_calls
    assert all(saved[layer] >= 2 for layer in LAYERS), saved
    assert set(sys.modules) - before == set()
