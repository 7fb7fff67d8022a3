"""Stand-in for vllm_ascend/patch/worker/patch_qwen3_5.py 0.18.0 (Qwen3.5 GDN).

Upstream copies ``AscendQwen3_5GatedDeltaNet._forward_core`` onto vLLM 0.18's
``Qwen3_5GatedDeltaNet``, a Qwen3-Next GDN subclass the installed vLLM no longer has: the
subclass below stands in for it. In 0.18 the anonymous save is inside ``_forward_core``.
"""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector
from vllm_ascend.utils import vllm_version_is


class Qwen3_5GatedDeltaNet(QwenGatedDeltaNetAttention):
    """Stands in for vLLM 0.18's ``vllm.model_executor.models.qwen3_5.Qwen3_5GatedDeltaNet``."""


class AscendQwen3_5GatedDeltaNet(Qwen3_5GatedDeltaNet):
    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ):
        forward_context = get_forward_context()
        attn_metadata = forward_context.attn_metadata
        if attn_metadata is None:
            return
        self_kv_cache = self.kv_cache[
            forward_context.virtual_engine if vllm_version_is("0.18.0") else 0
        ]
        self_kv_cache[0].add_(1)
        self_kv_cache[1].add_(1)
        torch_npu.LOG.append(("write", f"gdn:{self.prefix}"))
        core_attn_out.copy_(mixed_qkv)
        maybe_save_kv_layer_to_connector("", [])


Qwen3_5GatedDeltaNet._forward_core = AscendQwen3_5GatedDeltaNet._forward_core
