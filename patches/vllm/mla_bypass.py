"""``mla_bypass``: layerwise wait/save for Kimi-K3 MLA paths that skip vLLM's decorator.

Why: vLLM 0.27+ ships Kimi-K3 in ``vllm/models/kimi_k3/`` with its own MLA paths that
never reach ``unified_mla_attention_with_output`` (the op vLLM decorates with
``maybe_transfer_kv_layer``), so a layerwise connector never sees those layers' KV:

* NVIDIA (0.27-0.33): ``MultiHeadLatentAttention`` *is* the attention layer and runs its
  whole path (fused cache insert + prefill + decode) in ``_attention``.
* ROCm (0.32-0.33): ``KimiK3MultiHeadLatentAttentionWrapper.forward`` sends decode-only
  batches through ``_fused_decode`` (one fused AITER launch that also writes the cache);
  other batches go through the hooked ``MLAAttention``.

Neither model is compiled with Dynamo, so these methods run eagerly. UCM hooks the same
paths (UCM PR #1250). The survey of other bypassing ops, and why they are left out, is
in docs/PATCHES.md (``bypass-survey``), written by ``scripts/verify_targets.py --survey``.

Limit: ``_attention`` carries ``@eager_break_during_capture``; the wrapper sits outside it,
so under breakable / FULL CUDA-graph capture the hooks run at capture time only, exactly
as vLLM's own hooks would not run in FULL graphs. Use eager or PIECEWISE mode for
layerwise transfer (as for every layer; targets.md gotcha 4).
"""

from __future__ import annotations

from collections.abc import Callable

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _layer_hooks
from ucm_patch.records import PatchRecord, PatchSet

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~7 ms)
if TYPE_CHECKING:
    from typing import Any

    from ucm_patch.records import Wrapper

NAME = "mla_bypass"

WHY = (
    "Kimi-K3's own MLA paths (vllm/models/kimi_k3/) bypass maybe_transfer_kv_layer, so a "
    "layerwise connector never gets wait_for_layer_load / save_kv_layer for those layers."
)
REMOVAL = (
    "Delete when vLLM's Kimi-K3 MLA calls the connector (decorates its attention entry "
    "with maybe_transfer_kv_layer as models/step5 does); none as of vLLM 0.33."
)

# Leading parameters of each era's target (checked by scripts/verify_targets.py).
EXPECTED_PARAMS: dict[str, tuple[str, ...]] = {
    "vllm-0.27-kimi-k3-nvidia": ("self", "positions", "q", "kv_c_normed", "k_pe", "attn_out"),
    "vllm-0.32-kimi-k3-amd": (
        "self",
        "q",
        "kv_c_normed",
        "k_pe",
        "positions",
        "output_shape",
        "attn_metadata",
        "layer",
        "kv_cache",
    ),
}


# KimiK3MultiHeadLatentAttentionWrapper._fused_decode(self, q, ..., layer, kv_cache, ...):
# positions in ``args`` as wrapt passes them (without self).
FUSED_DECODE_LAYER_INDEX = EXPECTED_PARAMS["vllm-0.32-kimi-k3-amd"].index("layer") - 1
FUSED_DECODE_KV_CACHE_INDEX = EXPECTED_PARAMS["vllm-0.32-kimi-k3-amd"].index("kv_cache") - 1


def make_kimi_nvidia_wrapper() -> Wrapper:
    """``MultiHeadLatentAttention._attention``: the layer is the instance (``layer_name``)."""
    return _layer_hooks.make_method_wrapper("layer_name")


def make_kimi_amd_fused_decode_wrapper() -> Wrapper:
    """``_fused_decode``: the attention layer and its cache are arguments, not ``instance``.

    ``instance`` is the model-side wrapper module; the ``MLAAttention`` layer (arg 6)
    owns the name and the cache passed as arg 7 is what the fused kernel writes.
    """
    probe = _layer_hooks._connector_probe()
    begin, end, save = layerwise.begin, layerwise.end, layerwise.save
    layer_i, kv_i = FUSED_DECODE_LAYER_INDEX, FUSED_DECODE_KV_CACHE_INDEX

    def kimi_fused_decode_wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if probe._KV_CONNECTOR_AGENT is None:
            return wrapped(*args, **kwargs)
        layer = args[layer_i] if len(args) > layer_i else kwargs["layer"]
        layer_name = layer.layer_name
        md = begin(layer_name)
        if md is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            end(layer_name)
        save(layer_name, args[kv_i] if len(args) > kv_i else kwargs["kv_cache"], md)
        return result

    return kimi_fused_decode_wrapper


RECORDS: tuple[PatchRecord, ...] = (
    PatchRecord(
        name=NAME,
        era="vllm-0.27-kimi-k3-nvidia",
        target="vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention._attention",
        requires={"vllm": ">=0.27,<0.34"},
        skip_when=layerwise.idle,
        make_wrapper=make_kimi_nvidia_wrapper,
        why=WHY,
        upstream=(
            "vLLM 0.27.1-0.33: vllm/models/kimi_k3/nvidia/mla.py, a self-contained MLA layer "
            "(registers itself in static_forward_context under layer_name = prefix); UCM #1250."
        ),
        removal=REMOVAL,
    ),
    PatchRecord(
        name=NAME,
        era="vllm-0.32-kimi-k3-amd",
        target=("vllm.models.kimi_k3.amd.mla:KimiK3MultiHeadLatentAttentionWrapper._fused_decode"),
        requires={"vllm": ">=0.32,<0.34"},
        skip_when=layerwise.idle,
        make_wrapper=make_kimi_amd_fused_decode_wrapper,
        why=WHY,
        upstream=(
            "vLLM 0.32-0.33: vllm/models/kimi_k3/amd/mla.py, decode-only batches take the "
            "fused AITER path (_fused_decode), not MLAAttention."
        ),
        removal=REMOVAL,
    ),
)

PATCH_SET = PatchSet(
    name=NAME,
    library="vllm",
    description="Layerwise wait/save for Kimi-K3 MLA paths that bypass maybe_transfer_kv_layer.",
    records=RECORDS,
)
