"""Post-import hooks: run a callback right after a module is imported.

The design follows wrapt's ``importer.py`` (hooks per module name, a finder at the front
of ``sys.meta_path`` that wraps the real loader, hooks fired *outside* the registry lock)
but is kept here so that ``import ucm_patch`` does not import wrapt: wrapt 2.x imports
asyncio on import, more than the whole 30 ms start-up budget. wrapt itself is
imported only when a patch is actually applied, i.e. while vLLM is being imported.

The classes duck-type the importlib protocols instead of subclassing importlib.abc
(which would import more at start-up).

Lock discipline: ``_lock`` guards ``_hooks`` only. A hook is never called with it held,
because a hook may import (and so take the import lock), and another thread holding the
import lock may be waiting to register a hook: holding both in opposite orders deadlocks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

try:
    from importlib._bootstrap import _ModuleLockManager  # type: ignore[attr-defined]
except ImportError:  # another interpreter: see _ImportLockOf
    _ModuleLockManager = None

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}


def _reset_lock_in_child() -> None:
    """A fork can happen while another thread holds ``_lock``; the child must not inherit
    a lock owned by a thread that does not exist there."""
    global _lock
    _lock = threading.RLock()


os.register_at_fork(
    before=lambda: _lock.acquire(),
    after_in_parent=lambda: _lock.release(),
    after_in_child=_reset_lock_in_child,
)
_searching = threading.local()  # names this thread is resolving through find_spec
_finder: _PostImportFinder | None = None


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported; at once if it already is.

    The check and the registration happen under ``name``'s own import lock, which waits
    while another thread is importing ``name``. Without it, a module that is in
    ``sys.modules`` but still executing gets patched with its attributes missing, or a
    thread importing ``name`` passes our finder (no hook yet) and, before the module shows
    up in ``sys.modules``, this thread sees "not imported" and registers a hook that never
    fires. CI saw both: 1 round in 40 of the many-threads test.
    """
    with _ImportLockOf(name):
        with _lock:
            module = sys.modules.get(name)
            if module is None:
                _hooks.setdefault(name, []).append(hook)
                _install_finder()
                return
    hook(module)  # outside both locks: a hook may import


class _ImportLockOf:
    """Holds the import system's per-module lock of ``name`` (the one ``import`` takes from
    finding the spec to executing the module), so no import of ``name`` is half-way through.

    CPython keeps it private (``importlib._bootstrap._ModuleLockManager``, unchanged since
    3.3). If it is missing, or taking it would deadlock (this thread is inside an import that
    another thread importing ``name`` waits on: importlib raises ``_DeadlockError``), we go on
    without it: the race above is back, nothing hangs.
    """

    __slots__ = ("_manager",)

    def __init__(self, name: str) -> None:
        self._manager = _ModuleLockManager(name) if _ModuleLockManager is not None else None

    def __enter__(self) -> None:
        if self._manager is not None:
            try:
                self._manager.__enter__()
            except RuntimeError:  # importlib._bootstrap._DeadlockError
                self._manager = None

    def __exit__(self, *exc: object) -> None:
        if self._manager is not None:
            self._manager.__exit__(*exc)


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        hook(module)


def pending() -> dict[str, int]:
    """Module name -> number of hooks still waiting (introspection, tests)."""
    with _lock:
        return {name: len(hooks) for name, hooks in _hooks.items()}


class _LoaderProxy:
    """Delegates to the real loader, then fires the module's hooks."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first: pkg_resources & co. inspect __loader__ and
        # must not see the proxy (wrapt issue #221).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _fire(self._name, sys.modules.get(self._name, module))

    def __getattr__(self, item: str) -> Any:
        return getattr(self._loader, item)


class _PostImportFinder:
    """Intercepts imports of hooked module names only; everything else passes through."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _hooks:
            return None
        names: set[str] = getattr(_searching, "names", None) or set()
        if fullname in names:
            return None  # our own nested find_spec call below
        names.add(fullname)
        _searching.names = names
        try:
            from importlib.util import find_spec  # first hooked import only, not at start-up

            spec = find_spec(fullname)
        finally:
            names.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderProxy(spec.loader, fullname)
        return spec


def _install_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
