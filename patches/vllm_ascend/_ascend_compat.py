"""Version-dependent accessors for the vLLM-Ascend wrappers, resolved once at apply time.

Every function here runs inside a record's ``make_wrapper`` (when the target module is
imported), never per call: each returns a small callable specialised for the installed
versions, so the per-layer path does no feature detection and no imports.

What differs (targets.md sections 1.3, 4.6, 5):

* GDN KV cache. vLLM-Ascend's GDN core picks the layer's ``[conv_state, ssm_state]`` with
  ``self.kv_cache[forward_context.virtual_engine]`` (v0.11 to v0.17),
  ``self.kv_cache[forward_context.virtual_engine if vllm_version_is("0.18.0") else 0]``
  (v0.18) and ``self.kv_cache`` (v0.19+). The save must carry the cache the core really
  used, so the getter mirrors the expression of the era (checked against the source by
  ``local`` checks in gdn_layerwise.EXPECT).
* ``KVConnectorBase_V1.has_connector_metadata()`` exists from vLLM 0.12; vLLM-Ascend 0.11
  pairs vLLM 0.11, where the base class only has the ``_connector_metadata`` attribute.
"""

from __future__ import annotations

from collections.abc import Callable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~7 ms)
if TYPE_CHECKING:
    from typing import Any

KV_VIRTUAL_ENGINE = "virtual_engine"
KV_VIRTUAL_ENGINE_IF_VLLM_018 = "virtual_engine_if_vllm_0_18"
KV_DIRECT = "direct"

# The expression vLLM-Ascend's GDN core uses for each mode (verified in the source).
KV_CACHE_EXPR: dict[str, str] = {
    KV_VIRTUAL_ENGINE: "self.kv_cache[forward_context.virtual_engine]",
    KV_VIRTUAL_ENGINE_IF_VLLM_018: (
        "self.kv_cache[forward_context.virtual_engine if vllm_version_is('0.18.0') else 0]"
    ),
    KV_DIRECT: "self.kv_cache",
}


def forward_context_getter() -> Callable[[], Any]:
    """vLLM's ``get_forward_context`` (same module in every paired vLLM version)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context


def _kv_by_virtual_engine(layer: Any, forward_context: Any) -> Any:
    return layer.kv_cache[forward_context.virtual_engine]


def _kv_first(layer: Any, forward_context: Any) -> Any:
    return layer.kv_cache[0]


def _kv_direct(layer: Any, forward_context: Any) -> Any:
    return layer.kv_cache


def gdn_kv_cache_getter(mode: str) -> Callable[[Any, Any], Any]:
    """``(layer, forward_context) -> [conv_state, ssm_state]`` as the era's GDN core picks it.

    For ``KV_VIRTUAL_ENGINE_IF_VLLM_018`` vLLM-Ascend's own ``vllm_version_is`` decides,
    once: it is an exact-equality check that honours the ``VLLM_VERSION`` variable, so
    vLLM-Ascend 0.18.0 running with vLLM 0.18.1 indexes with 0, and so must the save.
    """
    if mode == KV_VIRTUAL_ENGINE:
        return _kv_by_virtual_engine
    if mode == KV_DIRECT:
        return _kv_direct
    if mode == KV_VIRTUAL_ENGINE_IF_VLLM_018:
        from vllm_ascend.utils import vllm_version_is

        return _kv_by_virtual_engine if vllm_version_is("0.18.0") else _kv_first
    raise ValueError(f"unknown GDN kv-cache mode {mode!r}; expected one of {sorted(KV_CACHE_EXPR)}")


def _has_metadata_method(connector: Any) -> bool:
    return bool(connector.has_connector_metadata())


def _has_metadata_attribute(connector: Any) -> bool:
    return getattr(connector, "_connector_metadata", None) is not None


def connector_has_metadata() -> Callable[[Any], bool]:
    """``connector -> bool``: vLLM's "has connector metadata this step" gate.

    ``has_connector_metadata()`` from vLLM 0.12; before that the attribute it reads.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if hasattr(KVConnectorBase_V1, "has_connector_metadata"):
        return _has_metadata_method
    return _has_metadata_attribute
