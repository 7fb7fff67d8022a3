"""Stand-in for vllm_ascend/ops/gdn.py on main at 182b75ea84ff (2026-08-22).

What changed against 0.19 - 0.25: ``forward`` no longer makes the anonymous save; it moved to
the end of ``_forward_core``, inside the GDN op (vllm-ascend PR #11917, so that it runs under
torch.compile), after the profile-run early return. ``forward``'s ``output`` defaults to None.
Neither method waits for the layer at this commit (#12711 adds that later: the scenario
tests/standins/scenarios/era_main.py adds it the way the reference describes).
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
        output: torch.Tensor = None,
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
        out = core_attn_out
        if output is not None:
            output[:num_tokens] = out
        return out

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
        maybe_save_kv_layer_to_connector("", [])
