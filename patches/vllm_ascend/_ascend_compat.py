"""Version-dependent facts of the vLLM-Ascend wrappers, resolved once at apply time.

Every function here runs inside a record's ``make_wrapper`` (when the target module is
imported), never per call, so the per-layer path does no feature detection and no imports.

GDN KV cache: vLLM-Ascend's GDN core picks the layer's ``[conv_state, ssm_state]`` with
``self.kv_cache[forward_context.virtual_engine]`` (v0.11 to v0.17),
``self.kv_cache[forward_context.virtual_engine if vllm_version_is("0.18.0") else 0]``
(v0.18) and ``self.kv_cache`` (v0.19+). The save must carry the cache the core really
used, so the bracket's stage mirrors the expression of the era (checked against the source
by ``local`` checks in gdn_layerwise.EXPECT). The has-connector-metadata gate of vLLM 0.11
(paired with vLLM-Ascend 0.11) is the hook API's: ``layerwise.has_metadata_check``.
"""

from __future__ import annotations

from ucm_patch.hooks import layerwise

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


def gdn_kv_stage(mode: str) -> str:
    """The layer bracket's ``stage`` for a GDN core of ``mode``: which element of the
    layer's ``kv_cache`` the era's core writes (:data:`KV_CACHE_EXPR`).

    For ``KV_VIRTUAL_ENGINE_IF_VLLM_018`` vLLM-Ascend's own ``vllm_version_is`` decides,
    once: it is an exact-equality check that honours the ``VLLM_VERSION`` variable, so
    vLLM-Ascend 0.18.0 running with vLLM 0.18.1 indexes with 0, and so must the save.
    """
    if mode == KV_VIRTUAL_ENGINE:
        return layerwise.STAGE_VIRTUAL_ENGINE
    if mode == KV_DIRECT:
        return layerwise.STAGE_NONE
    if mode == KV_VIRTUAL_ENGINE_IF_VLLM_018:
        from vllm_ascend.utils import vllm_version_is

        if vllm_version_is("0.18.0"):
            return layerwise.STAGE_VIRTUAL_ENGINE
        return layerwise.STAGE_FIRST
    raise ValueError(f"unknown GDN kv-cache mode {mode!r}; expected one of {sorted(KV_CACHE_EXPR)}")
