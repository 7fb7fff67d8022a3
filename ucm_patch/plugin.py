"""vLLM general plugin: ``ucm_patch = ucm_patch.plugin:register`` (``vllm.general_plugins``).

vLLM calls general plugins in every process it starts (API server, engine core, each
worker), and possibly more than once per process; ``register`` is idempotent. It runs
before the worker builds its model, so the post-import hooks are in place in time.
``VLLM_PLUGINS`` is an allow-list of entry-point names that also filters *platform*
plugins: on Ascend list ``ascend`` too (``VLLM_PLUGINS=ascend,ucm_patch``).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Activate ucm_patch in this process and register its KV connector with vLLM."""
    global _registered
    with _lock:
        if _registered:
            return
        import ucm_patch  # activates on first import unless UCM_PATCH=0

        if ucm_patch.enabled_by_env():
            if not ucm_patch.registry().active:
                ucm_patch.activate()
            _register_connector()
        _registered = True


def _register_connector() -> None:
    """Make ``kv_connector="UCMPatchConnector"`` resolvable by vLLM's factory.

    A vLLM whose factory moved must still start (the patches work for any connector):
    the failure is logged with the reason instead of raised, unless strict.
    """
    import logging

    from ucm_patch import environment

    try:
        from ucm_patch import connector

        connector.register_with_vllm()
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        if environment.current().strict:
            raise
        logging.getLogger("ucm_patch").warning(
            "ucm_patch: could not register UCMPatchConnector with vLLM (%s: %s); use "
            "kv_connector_module_path='ucm_patch.connector' instead",
            type(exc).__name__,
            exc,
        )
