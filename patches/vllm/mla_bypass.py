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
layerwise transfer, as for every layer: FULL graphs replay kernels without Python.
"""

from __future__ import annotations

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _layer_hooks
from ucm_patch.records import PatchRecord, records_from_rows
from ucm_patch.source_checks import arg_index, leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.records import Wrapper

NAME = "mla_bypass"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = "Layerwise wait/save for Kimi-K3 MLA paths that bypass maybe_transfer_kv_layer."

WHY = (
    "Kimi-K3's own MLA paths (vllm/models/kimi_k3/) bypass maybe_transfer_kv_layer, so a "
    "layerwise connector never gets wait_for_layer_load / save_kv_layer for those layers."
)
REMOVAL = (
    "Delete when vLLM's Kimi-K3 MLA calls the connector (decorates its attention entry "
    "with maybe_transfer_kv_layer as models/step5 does); none as of vLLM 0.33."
)

# Leading parameters of each era's target (``leading`` checks, verified against every vLLM
# wheel by tools.verify.vllm).
ATTENTION_PARAMS = ("self", "positions", "q", "kv_c_normed", "k_pe", "attn_out")
FUSED_DECODE_PARAMS = (
    "self",
    "q",
    "kv_c_normed",
    "k_pe",
    "positions",
    "output_shape",
    "attn_metadata",
    "layer",
    "kv_cache",
)
# KimiK3MultiHeadLatentAttentionWrapper._fused_decode(self, q, ..., layer, kv_cache, ...):
# positions in ``args`` as wrapt passes them (without self).
FUSED_DECODE_LAYER_INDEX = arg_index(FUSED_DECODE_PARAMS, "layer")
FUSED_DECODE_KV_CACHE_INDEX = arg_index(FUSED_DECODE_PARAMS, "kv_cache")


def make_kimi_nvidia_wrapper() -> Wrapper:
    """``MultiHeadLatentAttention._attention``: the layer is the instance (``layer_name``)."""
    return _layer_hooks.make_method_wrapper("layer_name")


def make_kimi_amd_fused_decode_wrapper() -> Wrapper:
    """``_fused_decode``: the attention layer and its cache are arguments, not ``instance``.

    ``instance`` is the model-side wrapper module; the ``MLAAttention`` layer (arg 6)
    owns the name and the cache passed as arg 7 is what the fused kernel writes.
    """
    return _layer_hooks.make_layer_argument_wrapper(
        FUSED_DECODE_LAYER_INDEX, FUSED_DECODE_KV_CACHE_INDEX
    )


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires make_wrapper upstream expect",
    (
        (
            "vllm-0.27-kimi-k3-nvidia",
            "vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention._attention",
            ">=0.27,<0.34",
            make_kimi_nvidia_wrapper,
            "vLLM 0.27.1-0.33: vllm/models/kimi_k3/nvidia/mla.py, a self-contained MLA layer "
            "(registers itself in static_forward_context under layer_name = prefix); UCM #1250.",
            (leading(ATTENTION_PARAMS),),
        ),
        (
            "vllm-0.32-kimi-k3-amd",
            "vllm.models.kimi_k3.amd.mla:KimiK3MultiHeadLatentAttentionWrapper._fused_decode",
            ">=0.32,<0.34",
            make_kimi_amd_fused_decode_wrapper,
            "vLLM 0.32-0.33: vllm/models/kimi_k3/amd/mla.py, decode-only batches take the "
            "fused AITER path (_fused_decode), not MLAAttention.",
            (leading(FUSED_DECODE_PARAMS),),
        ),
    ),
    skip_when=layerwise.idle,
    why=WHY,
    removal=REMOVAL,
)
