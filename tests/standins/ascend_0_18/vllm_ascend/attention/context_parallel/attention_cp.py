"""Stand-in for vllm_ascend/attention/context_parallel/attention_cp.py 0.18.0 (producer event)."""

from __future__ import annotations

import torch
import torch_npu

from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl, AscendMetadata


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
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event = torch.npu.Event()
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
            torch_npu._npu_reshape_and_cache(
                key=key,
                value=value,
                key_cache=self.key_cache,
                value_cache=self.value_cache,
                slot_indices=attn_metadata.slot_mapping,
            )
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event.record()
        return query, key, value, output
