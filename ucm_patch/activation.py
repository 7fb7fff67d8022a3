"""Process-wide activation: one registry per process, shared by every entry path.

``import ucm_patch`` and vLLM's general plugin (``ucm_patch.plugin:register``) both end
here, so toggles, strictness and idempotency behave the same whichever path (or both)
ran. Nothing here imports vLLM or torch: records are hooked on import of their targets.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping

from ucm_patch import environment
from ucm_patch.registry import Registry
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

_lock = threading.Lock()
_registry: Registry | None = None


def registry() -> Registry:
    """The process's registry, built from every known patch set on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                from ucm_patch.patches import all_patch_sets

                records = [r for ps in all_patch_sets() for r in ps.records]
                _registry = Registry(records)
    return _registry


def enabled_by_env(env: Mapping[str, str] | None = None) -> bool:
    """False when ``UCM_PATCH=0`` (or off/false/no) switches the package off."""
    return environment.read(env).enabled


def activate(
    patches: Mapping[str, bool] | None = None,
    *,
    strict: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> Registry:
    """Activate the enabled patches (idempotent; re-resolves toggles on each call).

    Args:
        patches: explicit per-patch switches by logical name; they win over the
            environment and the config file.
        strict: raise on any patch failure, and on an unknown ``UCM_PATCH_*`` variable
            (otherwise one WARNING); default from ``UCM_PATCH_STRICT``.
        env: environment to read (tests); default this process's
            (:func:`ucm_patch.environment.current`).
    """
    settings = environment.read(env)
    reg = registry()
    if not settings.enabled:
        return reg
    if strict is None:
        strict = settings.strict
    debug = settings.debug
    # Note kernel registrations from now on, for native-hook detection (ucm_patch.native).
    from ucm_patch import kernel_ledger

    kernel_ledger.watch()
    report_dir = settings.report_dir
    if report_dir and reg.on_event is None:
        reg.on_event = _jsonl_sink(report_dir)
    reg.activate(patches=patches, env=env, strict=strict, debug=debug)
    if reg.on_event is not None:
        reg.on_event("activate", {"argv": sys.argv[:3]})
    if debug:
        from ucm_patch.status_table import format_table

        # every column, one line per record: a log to grep, not a terminal to fit
        print(format_table(reg.report(), wide=True), file=sys.stderr)
    return reg


def _jsonl_sink(directory: str) -> Callable[[str, dict[str, Any]], None]:
    """Append activation / state events to ``<dir>/ucm_patch-<pid>.jsonl``.

    One file per process, written at each event (not at exit: vLLM kills its workers),
    so a test or an operator can see which processes were patched and how.
    """
    import json
    import multiprocessing

    os.makedirs(directory, exist_ok=True)
    lock = threading.Lock()

    def sink(event: str, details: dict[str, Any]) -> None:
        line = {
            "event": event,
            "pid": os.getpid(),
            "process": multiprocessing.current_process().name,
            **details,
        }
        with lock, open(os.path.join(directory, f"ucm_patch-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps(line) + "\n")

    return sink


def revert() -> None:
    """Undo every applied patch in this process."""
    registry().revert()


def report() -> list[dict[str, Any]]:
    """Structured status of every known record (see ``ucm-patch status``)."""
    return registry().report()
