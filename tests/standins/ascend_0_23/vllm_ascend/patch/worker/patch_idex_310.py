"""Stand-in for vllm_ascend/patch/worker/patch_idex_310.py 0.22.1rc1 - 0.25 (310P only)."""

from __future__ import annotations

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_ascend._310p.ops.fla.gdn_310 import AscendGatedDeltaNetAttention310

QwenGatedDeltaNetAttention._forward_core = AscendGatedDeltaNetAttention310._forward_core
