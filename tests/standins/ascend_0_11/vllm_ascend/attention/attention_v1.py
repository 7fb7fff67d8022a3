"""Stand-in for vllm_ascend/attention/attention_v1.py 0.11.0.

0.11 has no ``reshape_and_cache`` method: the op ``unified_ascend_attention_with_output``
writes the cache inline and calls the hooks it imported *by name* from ``attention.utils``.
"""

from __future__ import annotations

import torch
import torch_npu
from vllm.forward_context import get_forward_context

from vllm_ascend.attention.utils import (
    maybe_save_kv_layer_to_connector,
    wait_for_kv_layer_from_connector,
)


def unified_ascend_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    wait_for_kv_layer_from_connector(layer_name)
    forward_context = get_forward_context()
    self = forward_context.no_compile_layers[layer_name]
    kv_cache = self.kv_cache[forward_context.virtual_engine]
    slots = torch.arange(key.shape[0])
    torch_npu._npu_reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)
    output.copy_(query)
    maybe_save_kv_layer_to_connector(layer_name, kv_cache)
