"""The doors between modules stay shut: no package module reads another's ``_private`` names.

A module's private names (``_kv_state``, ``_lock``, ``_reap_locked`` ...) are its own to
change; a reader elsewhere breaks silently when they do. Every module under ``ucm_patch/``,
``patches/`` and ``hooks/`` (installed as ``ucm_patch``, ``ucm_patch.patches``,
``ucm_patch.hooks``) is read with ``ast``: an ``import`` of a private name from another
ucm_patch module, or an attribute ``m._name`` on a ucm_patch module ``m`` it imported, is
a violation. A package's private submodules (``_checks``, ``_vllm_compat``) are shared by
their package: siblings may import them, other packages may not. Tests are exempt (they
reach into state on purpose).

Also checked here: every package folder is listed in setup.cfg, so an installed wheel
carries what the checkout imports.
"""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# repository folder -> the package it installs as (setup.cfg package_dir)
ROOTS = {"ucm_patch": "ucm_patch", "patches": "ucm_patch.patches", "hooks": "ucm_patch.hooks"}


def _modules() -> Iterator[tuple[str, Path, bool]]:
    """(dotted module name, file, is a package __init__) for every installed module."""
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if parts and parts[0] in ROOTS and folder == "ucm_patch":
                continue  # never happens: patches/ and hooks/ are not under ucm_patch/
            yield ".".join([package, *parts]), path, path.name == "__init__.py"


MODULES = {name: (path, is_pkg) for name, path, is_pkg in _modules()}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, is_pkg: bool) -> str:
    return module if is_pkg else module.rpartition(".")[0]


def _may_use(reader: str, reader_is_pkg: bool, owner: str, name: str) -> bool:
    """A private ``name`` of ``owner`` is usable by ``reader`` only when it is a private
    submodule of the reader's own package."""
    submodule = f"{owner}.{name}"
    return submodule in MODULES and _package_of(reader, reader_is_pkg) == owner


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, is_pkg).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def violations(module: str, path: Path, is_pkg: bool, root: Path = REPO) -> list[str]:
    """Every private-name read of ``module`` (file ``path``), as ``file:line what``."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(root)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> ucm_patch module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ucm_patch") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            owner = _absolute(module, is_pkg, node)
            if not owner.startswith("ucm_patch"):
                continue
            for alias in node.names:
                if _private(alias.name) and not _may_use(module, is_pkg, owner, alias.name):
                    found.append(f"{where}:{node.lineno} imports {owner}.{alias.name}")
                if f"{owner}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{owner}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            owner = aliases[node.value.id]
            if owner != module and not _may_use(module, is_pkg, owner, node.attr):
                found.append(f"{where}:{node.lineno} reads {owner}.{node.attr}")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_reads_another_modules_private_names(module):
    path, is_pkg = MODULES[module]
    assert violations(module, path, is_pkg) == []


def test_the_check_sees_a_reach_in(tmp_path):
    """The checker itself: a planted reach-in and a planted private import are found, a
    public read is not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from ucm_patch.hooks import layerwise\n"
        "from ucm_patch.registry import _gate\n"
        "x = layerwise._inside\n"
        "y = layerwise.calls\n"
    )
    found = violations("ucm_patch.planted", planted, False, root=tmp_path)
    assert found == [
        "planted.py:2 imports ucm_patch.registry._gate",
        "planted.py:3 reads ucm_patch.hooks.layerwise._inside",
    ]


def test_every_package_is_installed():
    """setup.cfg lists every folder with an ``__init__.py`` (an unlisted one would be
    missing from a wheel while an editable checkout still imports it)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    packages = {name for name, (_, is_pkg) in MODULES.items() if is_pkg}
    assert packages == listed


# What only development tooling needs: building venvs, unpacking release archives, pip.
TOOLING = frozenset({"tools", "venv", "tarfile", "zipfile", "pip"})


def test_the_installed_package_imports_no_tooling():
    """Verification and docs tooling lives in ``tools/`` (not installed, issue #28): no
    installed module imports it, or what only that tooling needs. Serving processes get
    what serving needs."""
    found = []
    for name, (path, _is_pkg) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            found += [f"{name} imports {m}" for m in mods if m.split(".")[0] in TOOLING]
    assert not found, found
    assert not (REPO / "ucm_patch" / "verify").exists()
