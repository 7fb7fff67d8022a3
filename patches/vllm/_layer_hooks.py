"""Wrapper factories shared by the vLLM patch sets: bracket a layer's eager core with the
layerwise hooks, the way vLLM's ``maybe_transfer_kv_layer`` brackets attention.

Every factory runs at apply time: it calls :func:`ucm_patch.hooks.layerwise.bind` and
binds the version-dependent accessors of :mod:`._vllm_compat`, so the returned wrapper
does no import, no feature detection and no allocation per call. With no KV connector
active a wrapper costs three attribute loads and two compares (vLLM's KV-transfer state
and forward-context modules are bound once: :func:`_connector_probe`,
``_vllm_compat.forward_context_holder``) before calling the core; the layer name is not
even looked up. Outside a forward pass (no forward context) the core runs untouched.

Order per call (the contract the hooks document)::

    md = begin(name)            # None: gated out (no connector, no metadata, nested)
    try: core(...)
    finally: end(name)          # only when begin let the layer through
    save(name, kv_cache, md)    # only when the core returned normally

The wrappers spell this with :func:`~ucm_patch.hooks.layerwise.enter` and inline ``end``
and ``save``: the connector and the forward context are already in hand, and each saved
Python call is ~60-80 ns on a path with a 2 us budget per layer (issue 3).
"""

from __future__ import annotations

from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _vllm_compat

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~7 ms)
if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper


def _connector_probe() -> Any:
    """An object whose ``_KV_CONNECTOR_AGENT`` is vLLM's active connector or None.

    vLLM's ``kv_transfer_state`` module as bound by ``layerwise.bind()``; reading its
    attribute inline saves a Python call per layer per step on the no-connector path.
    When vLLM is not importable there is no connector: a stand-in that always says None.
    """
    state = layerwise._kv_state if layerwise.bind() else None
    return state if state is not None else _NoConnector


class _NoConnector:
    _KV_CONNECTOR_AGENT = None


def make_method_wrapper(name_attr: str = "prefix") -> Wrapper:
    """Wrapper for a method of the layer that owns the cache (``instance``).

    ``name_attr``: the instance attribute holding the layer name vLLM keys metadata and
    ``no_compile_layers`` with (``prefix`` for GDN layers, ``layer_name`` for MLA layers).
    The cache is the instance's (``kv_cache[virtual_engine]`` up to vLLM 0.18).
    """
    probe = _connector_probe()
    holder = _vllm_compat.forward_context_holder()
    per_stage = _vllm_compat.has_virtual_engine()
    enter, inside, calls = layerwise.enter, layerwise._inside, layerwise.calls

    def layer_method_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        conn = probe._KV_CONNECTOR_AGENT
        forward_context = holder._forward_context
        if conn is None or forward_context is None:
            return wrapped(*args, **kwargs)
        layer_name = getattr(instance, name_attr)
        md = enter(conn, layer_name, forward_context.attn_metadata)
        if md is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            inside.discard(layer_name)  # layerwise.end(), inlined
        kv_cache = instance.kv_cache
        if per_stage:  # vLLM <= 0.18: one cache per pipeline stage
            kv_cache = kv_cache[forward_context.virtual_engine]
        calls["save"] += 1  # layerwise.save(), inlined: conn is the active connector
        conn.save_kv_layer(layer_name, kv_cache, md)
        return result

    return layer_method_wrapper


def make_op_wrapper(layer_name_index: int) -> Wrapper:
    """Wrapper for a custom-op kernel that gets the layer *name* at ``layer_name_index``.

    The layer is looked up in ``forward_context.no_compile_layers`` as vLLM's kernels do;
    the name is normalised (``LayerName`` -> ``str``) with ``_resolve_layer_name`` where
    that exists (vLLM 0.20+). With no connector the name is not even resolved.
    """
    probe = _connector_probe()
    holder = _vllm_compat.forward_context_holder()
    per_stage = _vllm_compat.has_virtual_engine()
    resolve_name = _vllm_compat.layer_name_resolver()
    name_class = _vllm_compat.layer_name_class()
    enter, inside, calls = layerwise.enter, layerwise._inside, layerwise.calls

    def layer_op_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        conn = probe._KV_CONNECTOR_AGENT
        forward_context = holder._forward_context
        if conn is None or forward_context is None:
            return wrapped(*args, **kwargs)
        raw = args[layer_name_index] if len(args) > layer_name_index else kwargs["layer_name"]
        kind = raw.__class__  # LayerName (0.20+ dispatcher) or str, unwrapped without a call
        layer_name = raw if kind is str else raw.value if kind is name_class else resolve_name(raw)
        md = enter(conn, layer_name, forward_context.attn_metadata)
        if md is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            inside.discard(layer_name)  # layerwise.end(), inlined
        kv_cache = forward_context.no_compile_layers[layer_name].kv_cache
        if per_stage:  # vLLM <= 0.18: one cache per pipeline stage
            kv_cache = kv_cache[forward_context.virtual_engine]
        calls["save"] += 1  # layerwise.save(), inlined: conn is the active connector
        conn.save_kv_layer(layer_name, kv_cache, md)
        return result

    return layer_op_wrapper
