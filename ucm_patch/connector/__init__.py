"""The vLLM KV connector of ucm_patch, one module per job.

=====================  ==========================================================
``kv_connector``       :class:`UCMPatchConnector`, the facade vLLM builds; the
                       process-wide helpers (``wait_for_dumps``, ``release_finished``,
                       ``stats``, ``active_connectors``, ``register_with_vllm``)
``config``             ``kv_connector_extra_config`` parsed and validated
``layout``             the KV layout every process derives alike, and the store keys
``rows``               layers grouped into storage rows; the forward-order row loader
``meta``               what the scheduler side hands the worker side each step
``scheduler_side``     lookups, load and dump decisions (scheduler process)
``worker_side``        loads, layer waits and dumps into the dump scheduler (workers)
``counters``           process-wide counters behind ``stats()``
=====================  ==========================================================

vLLM names the connector ``ucm_patch.connector.UCMPatchConnector``
(``kv_connector_module_path``), so the facade's public names resolve here. They resolve
lazily: the submodules that need no vLLM (``config``, ``layout``, ``rows``) import without
it.
"""

from __future__ import annotations

from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.connector.kv_connector import (
        UCMPatchConnector,
        active_connectors,
        register_with_vllm,
        release_finished,
        stats,
        wait_for_dumps,
    )

__all__ = [
    "UCMPatchConnector",
    "active_connectors",
    "register_with_vllm",
    "release_finished",
    "stats",
    "wait_for_dumps",
]


def __getattr__(name: str) -> object:
    if name in __all__:
        from ucm_patch.connector import kv_connector

        return getattr(kv_connector, name)
    raise AttributeError(f"module 'ucm_patch.connector' has no attribute {name!r}")
