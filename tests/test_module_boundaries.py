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
from collections.abc import Iterable, Iterator
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


# -- no import circle, lazy or typing-only (issue #28) ------------------------------------------
def imports_of(module: str, path: Path, is_pkg: bool, known: Iterable[str]) -> set[str]:
    """The installed modules ``module`` imports anywhere in its file: at the top, inside a
    function (lazy) or under ``TYPE_CHECKING``. ``from pkg import sub`` counts as ``sub``
    when ``sub`` is a module."""
    known = set(known)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            owner = _absolute(module, is_pkg, node)
            names = [
                f"{owner}.{a.name}" if f"{owner}.{a.name}" in known else owner for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n in known and n != module)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_lazy_or_typing_only():
    """Each arrow between installed modules points one way. A circle hidden behind a lazy
    or ``TYPE_CHECKING`` import still ties the modules together (which one initialises
    first, which one a type names); the dump engine and the devices had one each."""
    graph = {
        name: imports_of(name, path, is_pkg, MODULES) for name, (path, is_pkg) in MODULES.items()
    }
    assert import_circles(graph) == []


def test_the_circle_check_sees_a_lazy_one(tmp_path):
    pkg = tmp_path / "ucm_patch"
    pkg.mkdir()
    (pkg / "a.py").write_text("from ucm_patch import b\n")
    (pkg / "b.py").write_text(
        "from ucm_patch.typing_guard import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ucm_patch.c import C\n"
    )
    (pkg / "c.py").write_text("def f():\n    from ucm_patch.a import x\n")
    names = {"ucm_patch.a", "ucm_patch.b", "ucm_patch.c", "ucm_patch.typing_guard"}
    graph = {
        n: imports_of(n, pkg / f"{n.rpartition('.')[2]}.py", False, names)
        for n in sorted(names - {"ucm_patch.typing_guard"})
    }
    assert import_circles(graph) == [["ucm_patch.a", "ucm_patch.b", "ucm_patch.c"]]


# -- the house as README draws it (issue #28, item 6) ---------------------------------------
ENTRY_POINTS = frozenset(
    {"ucm_patch", "ucm_patch.__main__", "ucm_patch.activation", "ucm_patch.plugin"}
    | {"ucm_patch.cli", "ucm_patch.docs"}
)
ROOMS = (  # module prefix -> room, first match wins
    ("ucm_patch.connector", "connector"),
    ("ucm_patch.patches", "patches"),
    ("ucm_patch.hooks.layerwise", "hooks.layerwise"),
    ("ucm_patch.hooks.dump", "hooks.dump"),
    ("ucm_patch.hooks.stores", "hooks.stores"),
    ("ucm_patch.hooks", "hooks"),
)
# README's "Layout" drawing, arrow by arrow (every room may also import the kernel)
DRAWN = {
    "entry points": {"patches", "connector", "hooks.dump", "hooks.stores", "kernel"},
    "patches": {"hooks", "hooks.layerwise", "kernel"},
    "connector": {"hooks.dump", "hooks.stores", "hooks", "kernel"},
    "hooks.dump": {"hooks.stores", "hooks", "kernel"},
    "hooks.stores": {"hooks", "kernel"},
    "hooks": {"hooks.layerwise", "kernel"},
    "hooks.layerwise": {"kernel"},
    "kernel": set(),
}


def room_of(module: str) -> str:
    if module in ENTRY_POINTS:
        return "entry points"
    for prefix, room in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return room
    return "kernel"


def test_rooms_import_as_the_readme_draws_them():
    arrows: dict[str, set[str]] = {room: set() for room in DRAWN}
    for name, (path, is_pkg) in MODULES.items():
        for target in imports_of(name, path, is_pkg, MODULES):
            a, b = room_of(name), room_of(target)
            if a != b:
                arrows[a].add(b)
    undrawn = {a: sorted(b - DRAWN[a]) for a, b in arrows.items() if b - DRAWN[a]}
    assert not undrawn, f"imports README's Layout drawing does not show: {undrawn}"
    both_ways = sorted((a, b) for a in arrows for b in arrows[a] if a in arrows.get(b, ()))
    assert not both_ways
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for room in ("ucm_patch.patches", "ucm_patch.connector", "hooks.dump", "hooks.stores"):
        assert room in readme
