"""Stand-in for vllm_ascend/attention/attention_v1.py 0.13.0.

``reshape_and_cache(key, value, kv_cache, attn_metadata)`` writes the cache when it has
(key_cache, value_cache) and, as upstream, creates ``reshape_cache_event`` only for
producers (``self.is_kv_producer``, from vLLM's ``KVTransferConfig.is_kv_producer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu


@dataclass
class AscendMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    reshape_cache_event: torch.npu.Event = None


class AscendAttentionBackendImpl:
    def __init__(self, is_kv_producer: bool) -> None:
        self.is_kv_producer = is_kv_producer
        self.key_cache = None
        self.value_cache = None

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        attn_metadata: AscendMetadata,
    ):
        if len(kv_cache) > 1:
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event = torch.npu.Event()
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
            slots = attn_metadata.slot_mapping
            torch_npu._npu_reshape_and_cache(
                key=key[: attn_metadata.num_actual_tokens],
                value=value[: attn_metadata.num_actual_tokens],
                key_cache=self.key_cache,
                value_cache=self.value_cache,
                slot_indices=slots[: attn_metadata.num_actual_tokens],
            )
            if self.is_kv_producer:
                attn_metadata.reshape_cache_event.record()
        return key, value
