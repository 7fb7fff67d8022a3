"""Whether vLLM's scheduler runs the mamba align split for an async KV load, read from the
syntax tree of its source (formatting does not matter; nothing is imported or run).

vLLM 0.22's ``Scheduler.schedule`` runs ``_mamba_block_aligned_split`` for every waiting
request, an async load's included, and its assert kills the engine core on an external
token. 0.23 - 0.26 split under ``if ... and not load_kv_async``; 0.27+ split only in the
branch after ``if load_kv_async:``. One rule, read by the connector at start
(``connector.vllm_support``) and by the ``hybrid_async_load`` patch at apply time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ast

SPLIT = "_mamba_block_aligned_split"
ASYNC = "load_kv_async"


def skips_split_for_async(tree: ast.AST) -> bool:
    """Whether ``tree`` never splits for an async load: a split under a test that
    negates ``load_kv_async``, or only in the ``else`` of ``if load_kv_async:``."""
    import ast

    def splits(nodes: list[ast.stmt]) -> bool:
        return any(
            isinstance(n, ast.Attribute) and n.attr == SPLIT
            for stmt in nodes
            for n in ast.walk(stmt)
        )

    def negates_async(test: ast.expr) -> bool:
        return any(
            isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)
            and isinstance(n.operand, ast.Name) and n.operand.id == ASYNC
            for n in ast.walk(test)
        )  # fmt: skip

    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        if negates_async(node.test) and splits(node.body):
            return True
        is_async = isinstance(node.test, ast.Name) and node.test.id == ASYNC
        if is_async and splits(node.orelse) and not splits(node.body):
            return True
    return False


__all__ = ["ASYNC", "SPLIT", "skips_split_for_async"]
