"""Where vLLM and vLLM-Ascend run the mamba "align" copy relative to the connector's loads.

The copy (``do_mamba_copy_block``) moves a request's boundary state into its running block
before the forward. tests/test_e2e_hybrid_layouts.py shows on real vLLM what each order
does to loaded states; this file pins which order each supported source has:

* vLLM (the installed 0.32): inside ``preprocess_mamba``, which ``execute_model`` calls
  before it enters ``maybe_get_kv_connector_output`` (where ``start_load_kv`` runs);
* vLLM-Ascend: its model runner calls the copy itself inside that context from 0.21 on
  (0.23.0 here; UCM's ``mamba_copy_order_patch`` exists because of it), and releases
  before ship no mamba align copy of their own.

The connector loads hybrid states asynchronously, so both orders serve it correctly and no
copy-order patch record exists; if a source changes order, this file says so first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from packaging.version import Version

from tools.verify import ascend_sources


def _verify() -> object:
    return ascend_sources


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and (getattr(n.func, "attr", None) == name or getattr(n.func, "id", None) == name)
    ]


def copy_sites(tree: ast.AST) -> list[str]:
    """'in-connector-context' or 'outside' for each ``do_mamba_copy_block`` call."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            _calls(item.context_expr, "maybe_get_kv_connector_output") for item in node.items
        ):
            inside.update(id(c) for stmt in node.body for c in _calls(stmt, "do_mamba_copy_block"))
    return [
        "in-connector-context" if id(c) in inside else "outside"
        for c in _calls(tree, "do_mamba_copy_block")
    ]


def _function(module: object, name: str) -> ast.FunctionDef:
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    (found,) = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return found


def test_vllm_copies_in_preprocess_before_the_connector_context() -> None:
    from vllm.v1.worker import gpu_model_runner, mamba_utils

    assert copy_sites(_function(mamba_utils, "preprocess_mamba")) == ["outside"]
    runner = _function(gpu_model_runner, "execute_model")
    assert copy_sites(runner) == []
    first_pre = min(c.lineno for c in _calls(runner, "preprocess_mamba"))
    first_ctx = min(c.lineno for c in _calls(runner, "maybe_get_kv_connector_output"))
    assert first_pre < first_ctx


@pytest.mark.parametrize("version", ["0.11.0", "0.13.0", "0.18.0", "0.23.0", "0.23.0.post1"])
def test_vllm_ascend_copy_order(version: str) -> None:
    verify = _verify()
    assert version in verify.PYPI  # type: ignore[attr-defined]
    root = verify.unpack(verify.download(version), version)  # type: ignore[attr-defined]
    runner = Path(root) / "vllm_ascend" / "worker" / "model_runner_v1.py"
    sites = copy_sites(ast.parse(runner.read_text())) if runner.exists() else []
    if Version(version) >= Version("0.21"):
        assert sites == ["in-connector-context"], sites
    else:
        assert "in-connector-context" not in sites, sites
