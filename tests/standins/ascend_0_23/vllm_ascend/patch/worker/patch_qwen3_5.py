"""Stand-in for vllm_ascend/patch/worker/patch_qwen3_5.py 0.22.1rc1 - 0.25 (here 0.23.0).

Copies the Ascend GDN ``forward`` / ``_forward_core`` (310P: the 310 core) onto
``_GDN_PATCH_TARGET``, vLLM's ``QwenGatedDeltaNetAttention`` (real, installed).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention as _GDNBaseCls,
)

from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention
from vllm_ascend.utils import is_310p

_GDN_PATCH_TARGET = _GDNBaseCls

if is_310p():
    from vllm_ascend._310p.ops.fla.gdn_310 import AscendGatedDeltaNetAttention310

    _GDN_PATCH_TARGET._forward_core = AscendGatedDeltaNetAttention310._forward_core
else:
    _GDN_PATCH_TARGET.forward = AscendGatedDeltaNetAttention.forward
    _GDN_PATCH_TARGET._forward_core = AscendGatedDeltaNetAttention._forward_core
