"""Stand-in for vllm_ascend/patch/worker/patch_qwen3_next.py 0.13.0 - 0.17.

Imported by ``NPUWorker.__init__`` (after vLLM's general plugins), it assigns its GDN
``forward`` / ``_forward_core`` onto vLLM's ``Qwen3NextGatedDeltaNet`` (the installed vLLM's
GDN layer stands in for that class). vLLM 0.12-0.18's op ``gdn_attention_core`` calls
``self._forward_core(mixed_qkv=, b=, a=, core_attn_out=)``: the installed vLLM's
``qwen_gdn_attention_core`` op does the same and is used here.
"""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention as Qwen3NextGatedDeltaNet,
)


class AscendQwen3Next_GatedDeltaNet:
    def forward(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
    ):
        core_attn_out = torch.zeros_like(hidden_states)
        torch.ops.vllm.qwen_gdn_attention_core(
            hidden_states, hidden_states, hidden_states, core_attn_out, self.prefix, False
        )
        output.copy_(core_attn_out)

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
        self_kv_cache = self.kv_cache[forward_context.virtual_engine]
        conv_state = self_kv_cache[0]
        ssm_state = self_kv_cache[1]
        conv_state.add_(1)
        ssm_state.add_(1)
        torch_npu.LOG.append(("write", f"gdn:{self.prefix}"))
        core_attn_out.copy_(mixed_qkv)


Qwen3NextGatedDeltaNet.forward = AscendQwen3Next_GatedDeltaNet.forward
Qwen3NextGatedDeltaNet._forward_core = AscendQwen3Next_GatedDeltaNet._forward_core
