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

The one wrapper below spells all of it out (``layerwise.enter``'s gates, ``end``,
``save``): the connector and the forward context are already in hand, and each Python
call saved is ~100-200 ns on the development VM, on a path with a 2 us budget per layer
(issue 3). ``tests/test_patches_vllm_wrappers.py`` holds it to the same gates as
:func:`~ucm_patch.hooks.layerwise.begin`.
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
    return _make_layer_wrapper(name_attr, -1)


def make_op_wrapper(layer_name_index: int) -> Wrapper:
    """Wrapper for a custom-op kernel that gets the layer *name* at ``layer_name_index``.

    The layer is looked up in ``forward_context.no_compile_layers`` as vLLM's kernels do;
    the name is normalised (``LayerName`` -> ``str``) as ``_resolve_layer_name`` does
    (vLLM 0.20+). With no connector the name is not even resolved.
    """
    return _make_layer_wrapper(None, layer_name_index)


def _make_layer_wrapper(name_attr: str | None, layer_name_index: int) -> Wrapper:
    """The layer bracket; ``name_attr`` set: method of the layer, else op kernel."""
    probe = _connector_probe()  # binds layerwise first: _has_metadata below is final
    holder = _vllm_compat.forward_context_holder()
    per_stage = _vllm_compat.has_virtual_engine()
    resolve_name = _vllm_compat.layer_name_resolver()
    name_class = _vllm_compat.layer_name_class()
    has_metadata = layerwise._has_metadata  # None: conn.has_connector_metadata() (0.12+)
    pick_metadata, inside, calls = layerwise.pick_metadata, layerwise._inside, layerwise.calls
    on_instance = name_attr is not None

    def layer_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        conn = probe._KV_CONNECTOR_AGENT
        forward_context = holder._forward_context
        if conn is None or forward_context is None:
            return wrapped(*args, **kwargs)
        if on_instance:
            layer_name = getattr(instance, name_attr)
        else:
            i = layer_name_index
            raw = args[i] if len(args) > i else kwargs["layer_name"]
            kind = raw.__class__  # LayerName (0.20+ dispatcher) or str, without a call
            if kind is str:
                layer_name = raw
            elif kind is name_class:
                layer_name = raw.value
            else:
                layer_name = resolve_name(raw)
        # layerwise.enter's gates, inlined: nested entry, no metadata for the layer
        # (profile / dummy runs), no connector metadata bound.
        if layer_name in inside:
            calls["skipped_nested"] += 1
            return wrapped(*args, **kwargs)
        all_md = forward_context.attn_metadata
        if all_md.__class__ is dict:
            md = all_md.get(layer_name)
        else:
            md = pick_metadata(all_md, layer_name)
        if md is None:
            return wrapped(*args, **kwargs)
        if not (conn.has_connector_metadata() if has_metadata is None else has_metadata(conn)):
            return wrapped(*args, **kwargs)
        inside.add(layer_name)
        try:
            calls["wait"] += 1
            conn.wait_for_layer_load(layer_name)
            result = wrapped(*args, **kwargs)
        finally:
            inside.discard(layer_name)  # layerwise.end()
        if on_instance:
            kv_cache = instance.kv_cache
        else:
            kv_cache = forward_context.no_compile_layers[layer_name].kv_cache
        if per_stage:  # vLLM <= 0.18: one cache per pipeline stage
            kv_cache = kv_cache[forward_context.virtual_engine]
        calls["save"] += 1  # layerwise.save(): conn is the active connector
        conn.save_kv_layer(layer_name, kv_cache, md)
        return result

    return layer_wrapper
