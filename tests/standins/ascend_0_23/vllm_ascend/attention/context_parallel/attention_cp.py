"""Stand-in for vllm_ascend/attention/context_parallel/attention_cp.py 0.23.0 (no event)."""

from __future__ import annotations

import torch
import torch_npu

from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl, AscendMetadata
from vllm_ascend.attention.utils import notify_kv_cache_written


class AscendAttentionCPImpl(AscendAttentionBackendImpl):
    def reshape_and_cache(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        attn_metadata: AscendMetadata,
        output: torch.Tensor,
    ):
        if len(kv_cache) > 1:
            torch_npu._npu_reshape_and_cache(
                key=key,
                value=value,
                key_cache=kv_cache[0],
                value_cache=kv_cache[1],
                slot_indices=attn_metadata.slot_mapping,
            )
            notify_kv_cache_written()
        return query, key, value, output
