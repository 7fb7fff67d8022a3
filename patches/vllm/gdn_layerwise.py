"""``gdn_layerwise``: layerwise wait/save for GDN (Qwen3-Next / Qwen3.5) layers.

Why: upstream vLLM never calls the KV connector from a GDN / linear-attention layer
(no file under ``layers/mamba/**`` references it, in any version), so a layerwise
connector sees ``model.layers.N.self_attn.attn`` but never ``model.layers.N.linear_attn``
and cannot save or load Qwen3-Next's conv/SSM state. Verified on vLLM 0.32 CPU: only
the full-attention layer reaches ``save_kv_layer``.

What: wrap the GDN core that runs *eagerly inside vLLM's custom op* (never a method
Dynamo traces: torch.compile drops wrapt wrappers on traced code silently), and bracket
it exactly like vLLM's ``maybe_transfer_kv_layer`` decorator brackets attention:
``wait_for_layer_load(prefix)`` before, ``save_kv_layer(prefix, [conv, ssm], md)`` after,
skipped with no KV-transfer group, no metadata (profile / dummy runs) or no connector
metadata. Nested entry methods (``_forward_core_rocm`` -> ``_forward_core``) fire once:
the layer bracket (``layerwise.layer_bracket``) refuses a layer already inside its core.

Eras (each checked against that release's source: docs/PATCHES.md, verification matrix):

==============  ========================================================================
vLLM            wrapped
==============  ========================================================================
0.10.2 - 0.11   ``qwen3_next.Qwen3NextGatedDeltaNet._forward`` (op ``gdn_attention``)
0.12 - 0.18     ``qwen3_next.Qwen3NextGatedDeltaNet._forward_core`` (op
                ``gdn_attention_core``)
0.19 - 0.21     ``mamba.gdn_linear_attn.GatedDeltaNetAttention._forward_core``
                (+ ``_forward_core_rocm`` from 0.21)
0.22 - 0.33     ``mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core``,
                ``_forward_core_rocm``, ``_forward_core_fused_norm_packed`` (0.28+)
0.21 - 0.33     CPU: kernel of op ``vllm::cpu_gdn_attention_core`` (``forward_cpu`` calls
                it and never reaches ``_forward_core``)
==============  ========================================================================

The patch carries no dump policy: :mod:`ucm_patch.hooks.layerwise` forwards to whatever
KV connector vLLM has active.
"""

from __future__ import annotations

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _layer_hooks
from ucm_patch.records import HOOKS, Kind, PatchRecord, records_from_rows
from ucm_patch.source_checks import arg_index, leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.records import Wrapper

NAME = "gdn_layerwise"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = "Layerwise wait_for_layer_load / save_kv_layer for GDN linear-attention layers."

WHY = (
    "vLLM never calls the KV connector from GDN / linear-attention layers, so a layerwise "
    "connector cannot load or save Qwen3-Next / Qwen3.5 conv+SSM state. The wrapper adds "
    "wait_for_layer_load before and save_kv_layer after the layer's eager GDN core, with "
    "the gates of vLLM's maybe_transfer_kv_layer."
)
REMOVAL = (
    "Delete when vLLM's GDN custom ops call the KV connector themselves (no upstream PR "
    "as of vLLM 0.33; vllm-ascend does it for its own GDN in #11917 / #12711)."
)


def make_method_wrapper(hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for a GDN layer method: the layer is ``instance``, its name ``prefix``."""
    return _layer_hooks.make_method_wrapper("prefix", hooks)


def make_cpu_op_wrapper(hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for the kernel of ``vllm::cpu_gdn_attention_core`` (layer name: arg 4)."""
    return _layer_hooks.make_op_wrapper(CPU_OP_LAYER_NAME_INDEX, hooks)


# Leading parameters of each era's target (``leading`` checks, verified against every vLLM
# wheel by tools.verify.vllm and used by the per-era unit tests).
_CORE = ("self", "mixed_qkv", "b", "a", "core_attn_out")
_ROCM_CORE = ("self", "qkvz", "ba", "z_out", "core_attn_out")
# cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name): the dispatcher
# passes the name positionally.
CPU_OP_PARAMS = ("mixed_qkv", "b", "a", "core_attn_out", "layer_name")
CPU_OP_LAYER_NAME_INDEX = arg_index(CPU_OP_PARAMS, "layer_name")

_QWEN3_NEXT = "vllm.model_executor.models.qwen3_next"
_GDN_019 = "vllm.model_executor.layers.mamba.gdn_linear_attn"
_GDN_022 = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_CPU_OPS = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"

RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires upstream expect callers",
    (
        (
            "vllm-0.10",
            f"{_QWEN3_NEXT}:Qwen3NextGatedDeltaNet._forward",
            ">=0.10.2,<0.12",
            "vLLM 0.10.2-0.11.x: op vllm::gdn_attention calls self._forward(hidden_states=, "
            "output=) eagerly (Qwen3-Next support, vLLM PR #24526).",
            (leading(("self", "hidden_states", "output")),),
            ("vllm::gdn_attention",),
        ),
        (
            "vllm-0.12",
            f"{_QWEN3_NEXT}:Qwen3NextGatedDeltaNet._forward_core",
            ">=0.12,<0.19",
            "vLLM 0.12-0.18.x: op vllm::gdn_attention_core calls self._forward_core(mixed_qkv=, "
            "b=, a=, core_attn_out=); KV cache indexed by forward_context.virtual_engine.",
            (leading(_CORE),),
            ("vllm::gdn_attention_core",),
        ),
        (
            "vllm-0.19",
            f"{_GDN_019}:GatedDeltaNetAttention._forward_core",
            ">=0.19,<0.22",
            "vLLM 0.19-0.21: GDN moved to layers/mamba/gdn_linear_attn.py (PluggableLayer); "
            "virtual_engine removed, kv_cache used directly.",
            (leading(_CORE),),
            ("vllm::gdn_attention_core",),
        ),
        (
            "vllm-0.21-rocm",
            f"{_GDN_019}:GatedDeltaNetAttention._forward_core_rocm",
            ">=0.21,<0.22",
            "vLLM 0.21: op gdn_attention_core(fast_kernel=True) calls _forward_core_rocm (AITER "
            "path), which may return without reaching _forward_core.",
            (leading(_ROCM_CORE),),
            ("vllm::gdn_attention_core",),
            {"optional": True},
        ),
        (
            "vllm-0.22",
            f"{_GDN_022}:QwenGatedDeltaNetAttention._forward_core",
            ">=0.22,<0.34",
            "vLLM 0.22-0.33: op vllm::qwen_gdn_attention_core (layers/mamba/gdn/"
            "qwen_gdn_linear_attn.py); layer_name is LayerName-encoded on the op path.",
            (leading(_CORE),),
            ("vllm::qwen_gdn_attention_core",),
        ),
        (
            "vllm-0.22-rocm",
            f"{_GDN_022}:QwenGatedDeltaNetAttention._forward_core_rocm",
            ">=0.22,<0.34",
            "vLLM 0.22-0.33: qwen_gdn_attention_core(use_aiter=True) calls _forward_core_rocm, "
            "which handles decode-only batches without _forward_core.",
            (leading(_ROCM_CORE),),
            ("vllm::qwen_gdn_attention_core",),
            {"optional": True},
        ),
        (
            "vllm-0.28-fused",
            f"{_GDN_022}:QwenGatedDeltaNetAttention._forward_core_fused_norm_packed",
            ">=0.28,<0.34",
            "vLLM 0.28-0.33: op vllm::qwen_gdn_attention_core_fused_norm_packed (fused GDN "
            "spec-decode path) calls _forward_core_fused_norm_packed, not _forward_core.",
            (leading(("self", "mixed_qkvz", "ba", "core_attn_out")),),
            ("vllm::qwen_gdn_attention_core_fused_norm_packed",),
            {"optional": True},
        ),
        (
            "vllm-0.21-cpu",
            f"{_CPU_OPS}:cpu_gdn_attention_core",
            ">=0.21,<0.34",
            "vLLM 0.21-0.33 CPU: cpu_gdn_attention_core registered lazily by "
            "register_cpu_gdn_attention_ops() from the GDN layer's __init__ "
            "(reads the module global, so the wrapped attribute is what gets registered).",
            (leading(CPU_OP_PARAMS),),
            (),  # the op-kernel record checks its own op's registered kernel
            {
                "make_wrapper": make_cpu_op_wrapper,
                "why": WHY + " On CPU, forward_cpu calls torch.ops.vllm.cpu_gdn_attention_core "
                "and never reaches _forward_core, so the op's kernel is overridden.",
                "kind": Kind.OP_KERNEL,
                "op": "vllm::cpu_gdn_attention_core",
                "dispatch_key": "CPU",
            },
        ),
    ),
    make_wrapper=make_method_wrapper,
    hooks=HOOKS,
    skip_when=layerwise.idle,
    why=WHY,
    removal=REMOVAL,
)
