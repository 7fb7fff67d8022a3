"""Stand-in for vllm_ascend/_310p/ops/fla/gdn_310.py 0.23.0: the anonymous save is in the core."""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention

from vllm_ascend.attention.utils import maybe_save_kv_layer_to_connector


class AscendGatedDeltaNetAttention310(GatedDeltaNetAttention):
    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ):
        forward_context = get_forward_context()
        if forward_context.attn_metadata is None:
            return
        self_kv_cache = self.kv_cache
        self_kv_cache[0].add_(1)
        self_kv_cache[1].add_(1)
        torch_npu.LOG.append(("write", f"gdn310:{self.prefix}"))
        core_attn_out.copy_(mixed_qkv)
        maybe_save_kv_layer_to_connector("", [])
