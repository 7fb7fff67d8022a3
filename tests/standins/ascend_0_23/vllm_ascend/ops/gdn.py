"""Stand-in for vllm_ascend/ops/gdn.py 0.19.1rc1 - 0.25 (here 0.23.0).

``AscendGatedDeltaNetAttention`` subclasses vLLM's ``GatedDeltaNetAttention`` (the installed
vLLM's class) and replaces it through ``CustomOp.register_oot``. ``forward`` runs the GDN op
(the installed vLLM's ``qwen_gdn_attention_core``, called exactly as upstream) and then makes
the anonymous ``maybe_save_kv_layer_to_connector("", [])`` call.
"""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention

from vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector


class AscendGatedDeltaNetAttention(GatedDeltaNetAttention):
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((2, 4), (2, 4))

    def forward(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
    ):
        num_tokens = hidden_states.size(0)
        core_attn_out = torch.zeros_like(hidden_states)
        torch.ops.vllm.qwen_gdn_attention_core(
            hidden_states,
            hidden_states,
            hidden_states,
            core_attn_out,
            self.prefix,
            False,
        )
        maybe_save_kv_layer_to_connector("", [])
        output[:num_tokens] = core_attn_out

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
        attn_metadata = attn_metadata[self.prefix]
        self_kv_cache = self.kv_cache
        self_kv_cache[0].add_(1)
        self_kv_cache[1].add_(1)
        torch_npu.LOG.append(("write", f"gdn:{self.prefix}"))
        core_attn_out.copy_(mixed_qkv)
