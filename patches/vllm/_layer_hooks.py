"""The vLLM layer patches' wrapper factories: where a vLLM layer keeps its name and cache.

The bracket itself (gate, ``wait_for_layer_load``, core, ``save_kv_layer``) is
:func:`ucm_patch.hooks.layerwise.layer_bracket`, shared with the vLLM-Ascend patches.
What is vLLM's alone is said here, once per factory, at apply time: the layer is the
method's instance (GDN ``prefix``, MLA ``layer_name``) or an op kernel's ``layer_name``
argument (a ``LayerName`` from vLLM 0.20's dispatcher), and up to vLLM 0.18 the cache a
layer owns is a list indexed by ``forward_context.virtual_engine``
(:mod:`._vllm_compat`).
"""

from __future__ import annotations

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _vllm_compat
from ucm_patch.records import HOOKS
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.records import Wrapper


def _stage() -> str:
    if _vllm_compat.has_virtual_engine():
        return layerwise.STAGE_VIRTUAL_ENGINE
    return layerwise.STAGE_NONE


def make_method_wrapper(name_attr: str = "prefix", hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for a method of the layer that owns the cache (``instance``).

    ``name_attr``: the instance attribute holding the layer name vLLM keys metadata and
    ``no_compile_layers`` with (``prefix`` for GDN layers, ``layer_name`` for MLA layers).
    ``hooks``: the calls to add (the registry passes the ones upstream does not make).
    """
    site = layerwise.LayerSite(
        name_attr=name_attr, stage=_stage(), **layerwise.site_for_hooks(hooks)
    )
    return layerwise.layer_bracket(site)


def make_op_wrapper(layer_name_index: int, hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for a custom-op kernel that gets the layer *name* at ``layer_name_index``.

    The layer is looked up in ``forward_context.no_compile_layers`` as vLLM's kernels do;
    the name is normalised (``LayerName`` -> ``str``) as ``_resolve_layer_name`` does
    (vLLM 0.20+). With no connector the name is not even resolved.
    """
    site = layerwise.LayerSite(
        layer=layerwise.LAYER_NAME_ARGUMENT,
        index=layer_name_index,
        name_class=_vllm_compat.layer_name_class(),
        resolve_name=_vllm_compat.layer_name_resolver(),
        stage=_stage(),
        **layerwise.site_for_hooks(hooks),
    )
    return layerwise.layer_bracket(site)


def make_layer_argument_wrapper(layer_index: int, kv_cache_index: int) -> Wrapper:
    """Wrapper for a call that gets the attention layer and the cache it writes as
    arguments (positions in wrapt's ``args``, keywords ``layer`` / ``kv_cache``); the
    layer's name is its ``layer_name``."""
    site = layerwise.LayerSite(
        layer=layerwise.LAYER_ARGUMENT,
        index=layer_index,
        key="layer",
        name_attr="layer_name",
        kv_index=kv_cache_index,
    )
    return layerwise.layer_bracket(site)
