"""Stand-in for vllm_ascend/models/qwen3_next.py 0.11.0: vLLM-Ascend's own Qwen3-Next GDN.

Upstream subclasses vLLM 0.11's ``Qwen3NextGatedDeltaNet``; the installed vLLM's GDN layer
stands in for it. vLLM 0.11's op ``gdn_attention`` calls ``self._forward(hidden_states=,
output=)``, which this subclass overrides.
"""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention as Qwen3NextGatedDeltaNet,
)


class CustomQwen3NextGatedDeltaNet(Qwen3NextGatedDeltaNet):
    def _forward(
        self,
        hidden_states: torch.Tensor,
        output: torch.Tensor,
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
        output.copy_(hidden_states)
