"""The source-tree model: one library's sources on disk, parsed with ``ast`` on demand.

Both verifiers read a release this way (a wheel or sdist unpacked, a source checkout, the
installed package found with ``importlib.util.find_spec``): nothing is imported, so a
release that cannot run here (CUDA, torch-npu) is read all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class SourceTree:
    """The folder ``root`` holding the package ``package`` (``vllm``, ``vllm_ascend``).

    Modules are named with dots (``vllm.attention.layer``); a definition inside one as
    ``"module:Qual.name"`` (the form of a record's target).
    """

    def __init__(self, root: Path, package: str) -> None:
        self.root = root
        self.package = package
        self._asts: dict[str, ast.Module | None] = {}
        self._texts: dict[str, str] = {}

    def path(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
        return None

    def is_package(self, module: str) -> bool:
        return (self.path(module) or Path()).name == "__init__.py"

    def text(self, module: str) -> str:
        if module not in self._texts:
            path = self.path(module)
            self._texts[module] = path.read_text(encoding="utf-8-sig") if path else ""
        return self._texts[module]

    def module(self, module: str) -> ast.Module | None:
        if module not in self._asts:
            path = self.path(module)
            self._asts[module] = ast.parse(self.text(module), str(path)) if path else None
        return self._asts[module]

    def all_modules(self) -> Iterator[str]:
        for path in sorted((self.root / self.package).rglob("*.py")):
            rel = path.relative_to(self.root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts)

    def mentioning(self, *words: str) -> Iterator[str]:
        """Modules whose source contains any of ``words`` (a cheap filter before parsing)."""
        for module in self.all_modules():
            text = self.text(module)
            if any(w in text for w in words):
                yield module

    def find(self, code: str) -> ast.FunctionDef | None:
        """The function ``code`` ("module:Qual.name") defined exactly there, else None."""
        module, _, qual = code.partition(":")
        node: ast.AST | None = self.module(module)
        for part in qual.split("."):
            if node is None:
                return None
            node = next(
                (
                    ch
                    for ch in ast.iter_child_nodes(node)
                    if isinstance(ch, (ast.ClassDef, ast.FunctionDef)) and ch.name == part
                ),
                None,
            )
        return node if isinstance(node, ast.FunctionDef) else None

    def resolve(self, dotted: str, qualname: str, depth: int = 0) -> Def | None:
        """The definition ``qualname`` reached from module ``dotted`` the way Python would
        reach it: through ``from X import name`` re-exports and through base classes."""
        tree = self.module(dotted)
        if tree is None or depth > 6:
            return None
        parts = qualname.split(".")
        scope: list[ast.stmt] = tree.body
        parent: Def | None = None
        for i, part in enumerate(parts):
            node = named(scope, part)
            if node is None:
                if i == 0:
                    origin = self.imported_from(dotted, part)
                    return self.resolve(origin, qualname, depth + 1) if origin else None
                if isinstance(parent, ast.ClassDef):
                    return self._from_bases(dotted, parent, ".".join(parts[i:]), depth)
                return None
            parent = node
            scope = node.body if isinstance(node, ast.ClassDef) else []
        return parent

    def _from_bases(self, dotted: str, cls: ast.ClassDef, rest: str, depth: int) -> Def | None:
        for base in cls.bases:
            name = ast.unparse(base).split("[")[0]
            if "." in name:
                continue
            if named(self.module(dotted).body, name) is not None:  # type: ignore[union-attr]
                found = self.resolve(dotted, f"{name}.{rest}", depth + 1)
            else:
                origin = self.imported_from(dotted, name)
                found = self.resolve(origin, f"{name}.{rest}", depth + 1) if origin else None
            if found is not None:
                return found
        return None

    def imported_from(self, dotted: str, name: str) -> str | None:
        """``X`` of a top-level absolute ``from X import name`` in ``dotted``."""
        tree = self.module(dotted)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if any((a.asname or a.name) == name for a in node.names):
                    return node.module
        return None

    def imports_by_name(self, module: str) -> dict[str, str]:
        """Module-level ``from X import name`` (also under if/try) -> {bound name: X}."""
        mod = self.module(module)
        out: dict[str, str] = {}
        if mod is None:
            return out
        is_pkg = self.is_package(module)
        for stmt in module_level(mod):
            if isinstance(stmt, ast.ImportFrom):
                src = resolve_from(module, stmt, is_pkg)
                for alias in stmt.names:
                    out[alias.asname or alias.name] = src
        return out

    def assignments(self, module: str) -> list[str]:
        """Module-level ``A.attr = B.attr`` statements as text."""
        mod = self.module(module)
        if mod is None:
            return []
        return [
            ast.unparse(stmt)
            for stmt in module_level(mod)
            if isinstance(stmt, ast.Assign)
            and all(isinstance(t, ast.Attribute) for t in stmt.targets)
        ]

    def op_registered_with(self, dotted: str, op_name: str) -> str | None:
        """The ``op_func`` expression registering ``op_name`` in module ``dotted``."""
        tree = self.module(dotted)
        if tree is None:
            return None
        for name, func in registered_ops(tree):
            if name == op_name:
                return ast.unparse(func)
        return None


def named(body: list[ast.stmt], name: str) -> Def | None:
    """The def / class ``name`` in ``body``; the last definition wins, as at run time."""
    found = None
    for node in body:
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.name == name
        ):
            found = node
    return found


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names as a signature check compares them (``*args``, ``**kwargs`` marked)."""
    a = fn.args
    out = [p.arg for p in [*a.posonlyargs, *a.args]]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def module_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under if/else/try (not inside defs)."""
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        stmt = todo.pop(0)
        yield stmt
        if isinstance(stmt, ast.If):
            todo += stmt.body + stmt.orelse
        elif isinstance(stmt, ast.Try):
            todo += stmt.body + stmt.orelse + stmt.finalbody
            for h in stmt.handlers:
                todo += h.body


def resolve_from(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    """The absolute module a (possibly relative) ``from ... import`` in ``module`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name`` (plain or as an attribute) anywhere under ``node``."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == name)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == name)
        )
    ]


def local_expr(fn: ast.FunctionDef, name: str) -> str | None:
    """The expression of the first ``name = ...`` inside ``fn``, as text."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in n.targets
        ):
            return ast.unparse(n.value)
    return None


def registered_ops(tree: ast.Module) -> Iterator[tuple[str, ast.expr]]:
    """(op name, ``op_func`` expression) of every ``direct_register_custom_op`` call."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fname = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if fname != "direct_register_custom_op":
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("op_name", node.args[0] if node.args else None)
        func = kw.get("op_func", node.args[1] if len(node.args) > 1 else None)
        if isinstance(name, ast.Constant) and func is not None:
            yield name.value, func
