"""Stand-in for vllm_ascend/attention/attention_v1.py 0.23.0.

No ``reshape_cache_event`` any more (PR #11444): ``reshape_and_cache`` and the INT8 C8
impl's ``_reshape_and_cache`` call ``notify_kv_cache_written()`` (without a layer name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.attention.utils import notify_kv_cache_written


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
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        attn_metadata: AscendMetadata,
        output: torch.Tensor,
    ):
        if len(kv_cache) > 1:
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
            torch_npu._npu_reshape_and_cache(
                key=key[: attn_metadata.num_actual_tokens],
                value=value[: attn_metadata.num_actual_tokens],
                key_cache=self.key_cache,
                value_cache=self.value_cache,
                slot_indices=attn_metadata.slot_mapping[: attn_metadata.num_actual_tokens],
            )
            notify_kv_cache_written()
        return query, key, value, output


class AscendC8AttentionBackendImpl(AscendAttentionBackendImpl):
    def _reshape_and_cache(
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
